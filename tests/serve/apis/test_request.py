"""The checks every API's reader shares: its own field names in the chat API's words, text as a message holds it."""

from __future__ import annotations

import pytest

from streamchat.serve.apis.request import ApiError, Limits, checked_text, refuse_unknown, renamed_settings


def test_settings_are_the_chat_apis_checks_under_this_apis_names() -> None:
    names = {"max_tokens": "max_output_tokens", "stop": "stop_sequences"}
    assert renamed_settings({"max_output_tokens": 5, "stop_sequences": ["##"]}, names) == {
        "max_new_tokens": 5,
        "stop": ("##",),
    }
    with pytest.raises(ApiError) as refused:
        renamed_settings({"stop_sequences": ["a"] * 5}, names)
    assert refused.value.param == "stop_sequences" and refused.value.message.startswith("'stop_sequences' must be")


def test_unknown_fields_are_refused_and_neutral_ones_taken() -> None:
    refuse_unknown({"a": 1, "label": "x", "tools": [], "gone": None}, {"a"}, {"label"}, {"tools": ([],)})
    with pytest.raises(ApiError, match="'tools' is not supported by streamchat: only \\[\\]"):
        refuse_unknown({"tools": [{}]}, (), (), {"tools": ([],)})
    with pytest.raises(ApiError, match="'b' is not supported"):
        refuse_unknown({"b": 0}, {"a"})


def test_text_is_checked_and_lone_surrogates_made_replacement_characters() -> None:
    assert checked_text("a\ud800b", "input", Limits()) == "a\ufffdb"
    with pytest.raises(ApiError, match="input must be a string"):
        checked_text(3, "input", Limits())
