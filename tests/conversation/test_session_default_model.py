"""The chat engine on the real default model (SmolLM2-135M-Instruct), where it is installed."""

import pytest

from streamchat.conversation.session import SessionOptions
from streamchat.generation.events import Evicted, TextDelta, TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.sessions import session_under_test

pytestmark = [pytest.mark.slow, pytest.mark.default_model]


def test_two_hundred_turns_through_four_sinks_and_a_252_token_window(default_model):
    settings = GenerationSettings(max_new_tokens=3, temperature=0.0)
    session = session_under_test(
        default_model.model, default_model.tokenizer, SessionOptions(keep=4, window=252, settings=settings)
    )
    storage = None
    for turn in range(200):
        events = list(session.chat(f"Turn {turn}. Say one word."))
        assert isinstance(events[-1], TurnFinished) and events[-1].stats.generated_tokens >= 1
        storage = storage or [layer.keys.data_ptr() for layer in session.cache.layers]
    stats = session.cache_stats()
    assert stats.used == 256 and stats.evicted == stats.seen - 256
    assert [layer.keys.data_ptr() for layer in session.cache.layers] == storage


def test_a_greedy_answer_survives_evictions_mid_reply(default_model):
    settings = GenerationSettings(max_new_tokens=60, temperature=0.0)
    session = session_under_test(
        default_model.model, default_model.tokenizer, SessionOptions(keep=4, window=40, settings=settings)
    )
    events = list(session.chat("What is the capital of France?"))
    reply = "".join(event.text for event in events if isinstance(event, TextDelta))
    assert "Paris" in reply
    first_text = next(i for i, event in enumerate(events) if isinstance(event, TextDelta))
    assert any(isinstance(event, Evicted) for event in events[first_text:])
