"""Exact resume: a session stopped and resumed from its saved state replies as if it had never stopped."""

import pytest
import torch

from streamchat.conversation.session import ChatSession, SessionOptions
from streamchat.conversation.state import session_tensors
from streamchat.errors import CacheStateError
from streamchat.generation.events import NotResumed, Replayed, Resumed, TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.storage.cache_file import StateKey, state_path
from streamchat.storage.journal import Journal
from tests.support.models import tiny_model
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
KEY = StateKey("tiny", "weights", "float32", "cpu", "none", "system", WINDOW)


def make_session(system_prompt="You are terse."):
    options = SessionOptions(window=WINDOW, settings=SETTINGS, system_prompt=system_prompt)
    return ChatSession(tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), options)


def play(session, journal, turns):
    for text in turns:
        journal.record_user(session, text)
        finished = [event for event in session.chat(text) if isinstance(event, TurnFinished)][-1]
        journal.record(session, finished.stats.stop_reason)


def journal_in(tmp_path):
    return Journal(tmp_path / "sessions", "tiny", {"keep": "system", "window": WINDOW}, pytest.fail)


def stopped_after_three(tmp_path):
    """Session B: three turns, its state written as streamchat writes it at exit; the journal's path."""
    session, journal = make_session(), journal_in(tmp_path)
    play(session, journal, TURNS[:3])
    assert session.cache_stats().evicted > 0 and session.cache.ledger.position_offset > 0  # evicted, rebased
    assert session.save_state(state_path(journal.path), KEY) > 0
    journal.close()
    return journal.path


def test_six_turns_in_one_go_equal_three_then_a_resume_then_three(tmp_path):
    uninterrupted, journal = make_session(), journal_in(tmp_path / "a")
    play(uninterrupted, journal, TURNS)

    path = stopped_after_three(tmp_path / "b")
    resumed, journal = make_session(), journal_in(tmp_path / "b")
    events = list(resumed.load(path, KEY))
    assert events[-1] == Resumed(messages=6, tokens=resumed.cache_stats().used)
    assert not any(isinstance(event, Replayed) for event in events)
    play(resumed, journal, TURNS[3:])

    assert resumed.transcript == uninterrupted.transcript
    assert resumed.cache_view() == uninterrupted.cache_view()
    assert resumed.cache_stats() == uninterrupted.cache_stats()
    for name, tensor in session_tensors(uninterrupted).items():
        assert torch.equal(session_tensors(resumed)[name], tensor), name


def test_a_replay_instead_would_not_give_the_same_replies(tmp_path):
    # What the exact resume buys: replayed, the cache and the draws differ, and so do the replies.
    uninterrupted, journal = make_session(), journal_in(tmp_path / "a")
    play(uninterrupted, journal, TURNS)
    path = stopped_after_three(tmp_path / "b")
    replayed, journal = make_session(), journal_in(tmp_path / "b")
    assert isinstance(list(replayed.load(path))[-1], Replayed)
    play(replayed, journal, TURNS[3:])
    assert replayed.transcript[:6] == uninterrupted.transcript[:6]
    assert replayed.transcript[6:] != uninterrupted.transcript[6:]


def test_a_state_that_does_not_fit_says_why_and_replays(tmp_path):
    path = stopped_after_three(tmp_path)
    other = make_session(system_prompt="You are terse.")
    other.keep = 4  # a run with another --keep whose key says it all the same (a damaged file, say)
    events = list(other.load(path, KEY))
    assert isinstance(events[0], NotResumed) and "the saved cache is 12 sinks + 48 window" in events[0].reason
    assert isinstance(events[-1], Replayed) and other.cache.sinks == 4


def test_the_state_is_not_written_while_a_turn_or_a_replay_is_half_done(tmp_path):
    path = tmp_path / "state.cache.safetensors"
    session = make_session()
    turn = session.chat("Hello there!")
    next(turn)
    assert session.save_state(path, KEY) is None and not path.exists()
    list(turn)
    replay = session.set_system_prompt("Be brief.")  # the cache still holds the old system prompt
    assert session.save_state(path, KEY) is None
    next(replay)
    assert session.save_state(path, KEY) is None
    list(replay)
    assert session.save_state(path, KEY) > 0


def test_a_session_never_sampled_from_resumes_with_its_seed():
    greedy = GenerationSettings(max_new_tokens=6, temperature=0.0, seed=5)
    options = SessionOptions(settings=greedy)
    session = ChatSession(tiny_model("llama", vocab_size=VOCAB), byte_level_tokenizer(), options)
    list(session.chat("Hi"))
    assert "sampler.random_state" not in session_tensors(session)


def test_tensors_that_do_not_match_the_cache_are_refused():
    from streamchat.conversation.state import restore_session_tensors

    session = make_session()
    list(session.chat("Hello there!"))
    tensors = session_tensors(session)
    del tensors["mirror.window"]
    with pytest.raises(CacheStateError, match=r"^the saved state does not fit this session \('mirror.window'\)$"):
        restore_session_tensors(make_session(), tensors, 11)
