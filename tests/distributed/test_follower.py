"""A follower applies rank 0's moves, feeding rank 0's tokens, with in-process stand-ins for the transport."""

import pytest

from streamchat.conversation.calls import Chat, ConversationMoves, Move, Regenerate, Reset, UpdateSettings
from streamchat.conversation.session_options import SessionOptions
from streamchat.conversation.state import ConversationState
from streamchat.distributed.follower import follow
from streamchat.distributed.leader import NOT_RESUMED, LeaderSession
from streamchat.distributed.lockstep import Exit
from streamchat.errors import OutOfMemoryError, RankLostError
from streamchat.generation.events import TextDelta
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.sessions import session_under_test
from tests.support.tokenizers import byte_level_tokenizer

VOCAB = 700
GREEDY = GenerationSettings(max_new_tokens=12, temperature=0.0)


class Recorder:
    """Rank 0's channel: every step it shares, in order."""

    leads = True

    def __init__(self):
        self.steps = []

    def share_token(self, token):
        self.steps.append(token)
        return token

    def agree_stop(self, requested):
        self.steps.append(bool(requested))
        return requested


class Replayer:
    """Another rank's channel: rank 0's steps, as they were recorded."""

    leads = False

    def __init__(self, steps, requests=()):
        self.rank = 1
        self._steps = iter(steps)
        self._requests = iter(requests)

    def share_token(self, token):
        assert token is None  # a follower never draws
        return next(self._steps)

    def agree_stop(self, requested):
        assert not requested  # nobody stops a follower but rank 0
        return next(self._steps)

    def receive(self):
        return next(self._requests)


def session(channel, seed=0, window=30):
    model = tiny_model("llama", vocab_size=VOCAB, seed=seed)
    return session_under_test(
        model, byte_level_tokenizer(), SessionOptions(window=window, settings=GREEDY, channel=channel)
    )


def stopped_after(events, session, tokens):
    """Consume a turn, asking for a stop after `tokens` text deltas (a Ctrl-C on rank 0)."""
    seen = 0
    for event in events:
        if isinstance(event, TextDelta):
            seen += 1
            if seen == tokens:
                session.stop()


def test_a_follower_feeds_rank_0s_tokens_and_stops_where_rank_0_stopped():
    recorder = Recorder()
    leader = session(recorder)
    requests = [Chat("Hello there"), Chat("Go on, at length."), Exit()]
    for _ in leader.chat("Hello there"):
        pass
    stopped_after(leader.chat("Go on, at length."), leader, 3)
    # A follower with other weights: its own greedy tokens would differ, but it feeds rank 0's.
    follower = session(Replayer(recorder.steps, requests), seed=1)
    follow(follower, follower.channel)
    assert follower.transcript == leader.transcript
    assert len(leader.transcript[-1]["content"]) < len(leader.transcript[1]["content"])  # the stop held
    assert follower.cache_view().token_ids == leader.cache_view().token_ids
    assert follower.cache_stats() == leader.cache_stats()
    assert follower.cache_stats().evicted > 0


def test_errors_every_rank_meets_are_rank_0s_to_report_and_the_follower_goes_on():
    recorder = Recorder()
    leader = session(recorder)
    for _ in leader.chat("Hi"):
        pass
    requests = [
        Regenerate(),  # nothing to regenerate yet: ConfigError on every rank
        UpdateSettings({"temperature": -1.0}),  # refused on every rank
        Chat("Hi"),
        Reset(),
        Exit(),
    ]
    follower = session(Replayer(recorder.steps, requests))
    follow(follower, follower.channel)
    assert follower.transcript == []  # reset, after the turn went through
    assert follower.cache_stats().seen == 0


class Exploding:
    def chat(self, text):
        raise OutOfMemoryError("out of memory on cpu while reading 9 tokens; try a smaller --window")


def test_out_of_memory_on_a_follower_ends_it_with_out_of_memorys_line_and_code():
    channel = Replayer([], [Chat("Hi")])
    with pytest.raises(RankLostError) as raised:
        follow(Exploding(), channel)
    assert str(raised.value) == "rank 1: out of memory on cpu while reading 9 tokens; try a smaller --window"
    assert raised.value.exit_code == OutOfMemoryError.exit_code


class Wire(Recorder):
    """Rank 0's end: every step it shares, and every move it sends."""

    rank = 0

    def __init__(self):
        super().__init__()
        self.sent = []

    def send(self, move):
        self.sent.append(move)


# One example of each call that moves the conversation, in an order where each changes something.
ANSWERED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How are you?"}]
MOVES = [
    ("chat", ("Hello there",)),
    ("update_settings", {"max_new_tokens": 6}),  # keywords: update_settings(max_new_tokens=6)
    ("regenerate", ()),
    ("set_system_prompt", ("Be brief.",)),
    ("replay", ([*ANSWERED, {"role": "user", "content": "And then?"}],)),
    ("recover", ()),  # drops the message that has no reply, and replays the rest
    ("restore", (ConversationState(ANSWERED, "Be kind.", GREEDY.changed({"max_new_tokens": 9})), NOT_RESUMED)),
    ("reset", ()),
]


def test_every_call_that_moves_the_conversation_reaches_the_followers():
    assert {name for name, _ in MOVES} == ConversationMoves.__abstractmethods__
    wire = Wire()
    led = session(wire)
    alone, leader = session(None), LeaderSession(led.session, led.driver, wire)
    after_each = []
    for name, args in MOVES:
        for target in (alone, leader):
            call = getattr(target, name)
            for _ in (call(**args) if isinstance(args, dict) else call(*args)) or ():
                pass
        after_each.append((leader.snapshot(), leader.cache_stats(), leader.cache_view()))
        assert after_each[-1] == (alone.snapshot(tensors=False), alone.cache_stats(), alone.cache_view()), name
    assert len(wire.sent) == len(MOVES) and {type(move) for move in wire.sent} == set(Move.__subclasses__())
    follower = session(Replayer(wire.steps), seed=1)  # other weights: it feeds rank 0's tokens all the same
    for (name, _), move, expected in zip(MOVES, wire.sent, after_each, strict=True):
        for _ in move.apply(follower) or ():
            pass
        assert (follower.snapshot(tensors=False), follower.cache_stats(), follower.cache_view()) == expected, name
