"""Requests read into what the engine takes: the conversation, the new message, the settings typed."""

from __future__ import annotations

import pytest

from streamchat.serve.apis.openai_chat import chat_request, finish_reason
from streamchat.serve.apis.request import ApiError, Limits


def test_a_request_is_its_system_prompt_history_new_message_and_settings() -> None:
    body = {
        "model": "anything",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "And now?", "name": "ada"},
        ],
        "max_completion_tokens": 64,
        "temperature": 0,
        "top_p": 0.5,
        "stop": ["\n\n", "User says"],
        "seed": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
    }
    request = chat_request(body, Limits())
    assert request.system == "Be brief.\n\nAnswer in English."
    assert request.history == [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}]
    assert (request.text, request.stream, request.include_usage) == ("And now?", True, True)
    assert request.settings == {
        "max_new_tokens": 64,
        "temperature": 0.0,
        "top_p": 0.5,
        "seed": 3,
        "stop": ("\n\n", "User says"),
    }
    assert type(request.settings["temperature"]) is float  # JSON's 0, as the setting's type


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("END", ("END",)),
        (['say "hi"', "two words", "it's", "\\n"], ('say "hi"', "two words", "it's", "\\n")),
        (["lone \ud800"], ("lone \ufffd",)),  # a lone surrogate, as every message's text
        ([], ()),
    ],
)
def test_stop_strings_are_kept_as_sent(stop: object, expected: tuple[str, ...]) -> None:
    request = chat_request({"messages": [{"role": "user", "content": "a"}], "stop": stop}, Limits())
    assert request.settings == {"stop": expected}


def test_a_request_that_sets_nothing_changes_nothing() -> None:
    assert chat_request({"messages": [{"role": "user", "content": "a"}], "seed": None}, Limits()).settings == {}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ("[]", None),
        ({"messages": [{"role": "user", "content": "a"}], "max_tokens": True}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "a"}], "temperature": float("nan")}, "temperature"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "a"}], "stream_options": {"x": 1}}, "stream_options"),
    ],
)
def test_what_is_refused_is_named(body: object, param: str | None) -> None:
    with pytest.raises(ApiError) as refused:
        chat_request(body, Limits())
    assert (refused.value.status, refused.value.param) == (400, param)


def test_finish_reasons() -> None:
    assert [finish_reason(reason) for reason in ("eos", "stop_string", "max_new_tokens", "interrupted")] == [
        "stop",
        "stop",
        "length",
        "interrupted",
    ]
