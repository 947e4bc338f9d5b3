"""A conversation as a value: a session restored from its snapshot replies as if it had never stopped."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from streamchat.conversation.session import SessionOptions
from streamchat.conversation.state import TensorState
from streamchat.conversation.tensors import restore_tensors
from streamchat.errors import CacheStateError
from streamchat.generation.events import NotResumed, Replayed, Resumed, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.conversation import mirror_era_state
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer

VOCAB = 700
# Sampled, so that the random state matters; a window of 48 that the six turns overflow
# many times over, so that evictions and position rebases happen before and after the stop.
SETTINGS = GenerationSettings(max_new_tokens=24, temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=11)
WINDOW = 48
TURNS = [
    "Hello there!",
    "What is the capital of France?",
    "Tell me about the sea.",
    "Write a short poem about the stars.",
    "Numbers: 1 2 3, what comes next?",
    "Thank you, goodbye.",
]


def make_session(system_prompt="You are terse."):
    options = SessionOptions(window=WINDOW, settings=SETTINGS, system_prompt=system_prompt)
    return session_under_test(tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), options)


def play(session, turns):
    for text in turns:
        [event for event in session.chat(text) if isinstance(event, TurnFinished)]


def stopped_after_three():
    """Session B: three turns, then taken as a value (as streamchat takes it to write at exit)."""
    session = make_session()
    play(session, TURNS[:3])
    assert session.cache_stats().evicted > 0 and session.cache.ledger.position_offset > 0  # evicted, rebased
    state = session.snapshot()
    assert state.tensors is not None
    return state


def test_six_turns_in_one_go_equal_three_then_a_restore_then_three():
    uninterrupted = make_session()
    play(uninterrupted, TURNS)

    resumed = make_session()
    events = list(resumed.restore(stopped_after_three()))
    assert events[-1] == Resumed(messages=6, tokens=resumed.cache_stats().used)
    assert not any(isinstance(event, Replayed) for event in events)
    play(resumed, TURNS[3:])

    assert resumed.transcript == uninterrupted.transcript
    assert resumed.cache_view() == uninterrupted.cache_view()
    assert resumed.cache_stats() == uninterrupted.cache_stats()
    expected, got = uninterrupted.snapshot().tensors, resumed.snapshot().tensors
    assert expected.seed == got.seed and expected.tensors.keys() == got.tensors.keys()
    for name, tensor in expected.tensors.items():
        assert torch.equal(got.tensors[name], tensor), name


def test_a_replay_instead_would_not_give_the_same_replies():
    # What the exact restore buys: replayed, the cache and the draws differ, and so do the replies.
    uninterrupted = make_session()
    play(uninterrupted, TURNS)
    replayed = make_session()
    state = dataclasses.replace(stopped_after_three(), tensors=None)
    assert isinstance(list(replayed.restore(state))[-1], Replayed)
    play(replayed, TURNS[3:])
    assert replayed.transcript[:6] == uninterrupted.transcript[:6]
    assert replayed.transcript[6:] != uninterrupted.transcript[6:]


def test_a_state_that_does_not_fit_says_why_and_replays():
    state = stopped_after_three()
    other = make_session(system_prompt="You are terse.")
    other.keep = 4  # a session with another --keep given the state all the same (a damaged file, say)
    events = list(other.restore(state))
    assert isinstance(events[0], NotResumed) and "the saved cache is 12 sinks + 48 window" in events[0].reason
    assert isinstance(events[-1], Replayed) and other.cache.sinks == 4


def test_no_tensors_are_taken_while_a_turn_or_a_replay_is_half_done():
    session = make_session()
    turn = session.chat("Hello there!")
    next(turn)
    assert session.snapshot().tensors is None
    list(turn)
    replay = session.set_system_prompt("Be brief.")  # the cache still holds the old system prompt
    assert session.snapshot().tensors is None
    next(replay)
    assert session.snapshot().tensors is None
    list(replay)
    assert session.snapshot().tensors is not None
    assert session.snapshot(tensors=False).tensors is None


def test_a_session_never_sampled_from_resumes_with_its_seed():
    greedy = GenerationSettings(max_new_tokens=6, temperature=0.0, seed=5)
    options = SessionOptions(settings=greedy)
    session = session_under_test(tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), options)
    list(session.chat("Hi"))
    assert "sampler.random_state" not in session.snapshot().tensors.tensors


def test_tensors_that_do_not_match_the_cache_are_refused():
    session = make_session()
    list(session.chat("Hello there!"))
    tensors = dict(session.snapshot().tensors.tensors)
    del tensors["mirror.window"]
    other = make_session()
    with pytest.raises(CacheStateError, match=r"^the saved state does not fit this session \('mirror.window'\)$"):
        restore_tensors(other.cache, TensorState(tensors, 11), other.device)


def test_a_state_file_written_while_a_mirror_kept_the_tokens_resumes_as_it_did_then():
    # Written by the code of that time (tests/conversation/mirror_era_state.py says how): the mirror.* tensors
    # are read into the cache's record, and the session goes on as that code's restored session went on.
    expected = json.loads(mirror_era_state.EXPECTED.read_text(encoding="utf-8"))
    tensors = load_file(mirror_era_state.STATE)
    assert tensors["mirror.forgotten"][0] > tensors["cache.ledger"][5]  # more forgotten than evicted: a skip
    session = mirror_era_state.resumed(expected)
    assert dataclasses.asdict(session.cache_view()) == _listed(expected["view"])
    mirror_era_state.play(session, mirror_era_state.AFTER)
    assert session.transcript == expected["transcript_after"]
    assert dataclasses.asdict(session.cache_view()) == _listed(expected["view_after"])
    # Written again, the state holds the same tensors under the same names.
    again = session.snapshot().tensors.tensors
    assert {name for name in again if name.startswith("mirror.")} == {
        "mirror.sinks",
        "mirror.window",
        "mirror.forgotten",
    }


def _listed(view: dict) -> dict:
    """A view as JSON gave it back (lists), with the tuples a CacheView holds."""
    return {name: tuple(value) if isinstance(value, list) else value for name, value in view.items()}
