"""Rank 0's LeaderSession: what it sends the other ranks, and when; with an in-process stand-in for the transport."""

import dataclasses

import pytest

from streamchat.conversation.calls import Chat, Conversation, Reset, Restore, UpdateSettings
from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.distributed.leader import NOT_RESUMED, LeaderSession
from streamchat.distributed.lockstep import Exit
from streamchat.engine.engine import Engine
from streamchat.errors import ConfigError, OutOfMemoryError, PeerLostError, RankLostError
from streamchat.generation.driver import Driver
from streamchat.generation.events import NotResumed, Replayed, TextDelta, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer

GREEDY = GenerationSettings(max_new_tokens=10, temperature=0.0)


class Wire:
    """Records the requests rank 0 sends, and shares its steps like a one-rank world."""

    leads = True
    rank = 0

    def __init__(self):
        self.sent = []

    def send(self, request):
        self.sent.append(request)

    def share_token(self, token):
        return token

    def agree_stop(self, requested):
        return requested


def leader(wire=None):
    wire = wire or Wire()
    model = tiny_model("llama", vocab_size=700)
    session = ChatSession(model, byte_level_tokenizer(), SessionOptions(window=30, settings=GREEDY, channel=wire))
    return LeaderSession(session, Driver(Engine(model)), wire), wire


def test_each_call_that_moves_the_conversation_is_sent_before_it_runs_here():
    session, wire = leader()
    events = session.chat("Hello")
    assert wire.sent == [Chat("Hello")]
    assert any(isinstance(event, TurnFinished) for event in events)
    session.update_settings(temperature=0.5)
    session.reset()
    assert wire.sent[1:] == [UpdateSettings({"temperature": 0.5}), Reset()]
    assert session.transcript == [] and ("temperature", "0.5") in session.options()  # read on rank 0


def test_each_read_is_rank_0s_session_read_there():
    session, wire = leader()
    list(session.chat("Hello"))
    inner = session.session
    view = inner.cache_view()
    assert session.transcript is inner.transcript and session.transcript[0]["content"] == "Hello"
    assert (session.system_prompt, session.seed, session.keep) == (inner.system_prompt, inner.seed, inner.keep)
    assert session.options() == inner.options() and session.cache_stats() == inner.cache_stats()
    assert session.cache_view() == view and session.decode(view.sink_ids) == inner.decode(view.sink_ids)
    assert wire.sent == [Chat("Hello")]  # reading sends nothing


def test_a_bad_setting_is_refused_before_any_rank_changes():
    session, wire = leader()
    with pytest.raises(ConfigError):
        session.update_settings(temperature=-1.0)
    assert wire.sent == []


def test_restore_sends_the_conversation_without_tensors_and_snapshots_carry_none():
    session, wire = leader()
    list(session.chat("Hello"))
    assert session.snapshot().tensors is None  # each rank holds a shard of the cache
    exact = session.session.snapshot()
    assert exact.tensors is not None
    events = list(session.restore(exact))
    text_only = dataclasses.replace(exact, tensors=None)
    assert wire.sent[-1] == Restore(text_only, NOT_RESUMED)
    assert NotResumed(NOT_RESUMED) in events and isinstance(events[-1], Replayed)
    assert session.transcript == exact.messages


def test_a_turn_abandoned_on_rank_0_is_stopped_and_finished_as_on_the_other_ranks():
    session, _ = leader()
    events = session.chat("Hello")
    for event in events:
        if isinstance(event, TextDelta):
            break
    events.close()  # a closed pipe, say
    assert session.transcript[-1]["role"] == "assistant" and session.transcript[-1]["content"]
    assert session.session._settled  # the reply was closed in the cache, as on every rank


def test_close_tells_the_other_ranks_to_exit_once():
    session, wire = leader()
    session.close()
    session.close()
    assert wire.sent == [Exit()]


def test_out_of_memory_on_rank_0_ends_the_run_with_its_line_and_code():
    session, _ = leader()

    def exploding(*args):
        raise OutOfMemoryError("out of memory on cpu while generating; try a smaller --window")
        yield

    session.session.chat = exploding
    with pytest.raises(RankLostError) as raised:
        list(session.chat("Hello"))
    assert str(raised.value) == (
        "rank 0: out of memory on cpu while generating; try a smaller --window; every rank stops"
    )
    assert raised.value.exit_code == OutOfMemoryError.exit_code


def test_a_collective_that_fails_because_a_peer_died_is_a_peer_lost_error():
    session, _ = leader()

    def broken(*args):
        raise RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
            "[127.0.0.1]:21633. This is typically caused by a remote worker crashing. GLHF!"
        )
        yield

    session.session.chat = broken
    with pytest.raises(PeerLostError) as raised:
        list(session.chat("Hello"))
    assert str(raised.value) == (
        "rank 0 lost the other ranks while running a step: Connection closed by peer [127.0.0.1]:21633"
    )


def test_the_app_is_told_that_a_second_ctrl_c_must_not_tear_a_step():
    session, _ = leader()
    assert isinstance(session, Conversation)
    assert session.steps_in_lockstep  # a ChatSession alone does not (tests/conversation/test_calls.py)
