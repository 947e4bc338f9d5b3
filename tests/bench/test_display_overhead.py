"""The display benchmark: both sides give the same greedy reply, and the table shows each trial's speeds."""

import pytest

from streamchat.bench.display_overhead import (
    PROMPT,
    DisplayOverhead,
    DisplaySizes,
    checks,
    measure_display_overhead,
    rows,
)
from streamchat.conversation.driven import driven_session
from streamchat.conversation.session_options import SessionOptions
from streamchat.errors import ConfigError
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from tests.support.models import tiny_model
from tests.support.tokenizers import byte_level_tokenizer


def test_the_app_and_the_engine_generate_the_same_reply():
    model, tokenizer = tiny_model("llama", vocab_size=700), byte_level_tokenizer()
    sizes = DisplaySizes(trials=3, max_new_tokens=6, window=40, sinks=4)
    result = measure_display_overhead(model, tokenizer, sizes)
    settings = GenerationSettings(max_new_tokens=6, temperature=0.0)
    session = driven_session(model, tokenizer, SessionOptions(keep=4, window=40, settings=settings))
    [expected] = [event.reply for event in session.chat(PROMPT) if isinstance(event, TurnFinished)]
    assert expected
    assert result.engine_replies == result.app_replies == [expected] * 3
    assert len(result.engine_tokens_per_second) == len(result.app_tokens_per_second) == 3
    assert all(speed > 0 for speed in result.engine_tokens_per_second + result.app_tokens_per_second)


def test_rows_and_the_check_come_from_each_sides_speeds():
    result = DisplayOverhead([10.0, 30.0, 20.0], [19.0, 9.0, 29.0], ["a"] * 3, ["a"] * 3)
    assert rows(result) == [
        {"trial": 1, "engine": 10.0, "app": 19.0},
        {"trial": 2, "engine": 30.0, "app": 9.0},
        {"trial": 3, "engine": 20.0, "app": 29.0},
    ]
    [check] = checks(result)
    assert (check.name, check.value, check.met) == ("app / engine decode speed (medians)", 19.0 / 20.0, True)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        ({"trials": 0}, "--trials 0: must be at least 1"),
        ({"max_new_tokens": 1}, "--max-new-tokens 1: must be at least 2"),
        ({"window": 0}, "--window 0: must be at least 1"),
    ],
)
def test_impossible_sizes_are_refused_naming_the_option(sizes, message):
    with pytest.raises(ConfigError, match=message):
        DisplaySizes(**({"trials": 1, "max_new_tokens": 2, "window": 8} | sizes))
