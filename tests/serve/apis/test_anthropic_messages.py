"""Anthropic Messages requests read into the chat API's ChatRequest; replies, stop reasons and errors in its shapes."""

from __future__ import annotations

import pytest

from streamchat.cache.ledger import CacheStats
from streamchat.serve.apis.anthropic_messages import error_body, message, messages_request
from streamchat.serve.apis.request import ApiError, Limits
from streamchat.serve.turn import Finished

HELLO = [{"role": "user", "content": "Hello!"}]


def finished(stop_reason: str, reply: str = "Hi.", stop_string: str | None = None) -> Finished:
    cache = CacheStats(0, 4, 0, 64, 0, 0)
    return Finished(reply, stop_reason, 30, completion_tokens=3, cached_tokens=20, cache=cache, stop_string=stop_string)


def test_a_request_is_its_system_history_new_message_and_settings() -> None:
    body = {
        "model": "claude-anything",
        "max_tokens": 64,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in English."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "Hello.", "citations": None}]},
            {"role": "user", "content": [{"type": "text", "text": "And now?", "cache_control": {"type": "ephemeral"}}]},
        ],
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0,
        "top_p": 0.5,
        "top_k": 40,
        "stream": True,
        "metadata": {"user_id": "ada"},
        "cache_control": {"type": "ephemeral"},
        "tools": [],
        "thinking": {"type": "disabled"},
    }
    chat = messages_request(body, Limits())
    assert chat.system == "Be brief.\n\nAnswer in English."
    assert chat.history == [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}]
    assert (chat.text, chat.stream, chat.model, chat.logprobs) == ("And now?", True, "claude-anything", None)
    assert chat.settings == {
        "max_new_tokens": 64,
        "temperature": 0.0,
        "top_p": 0.5,
        "top_k": 40,
        "stop": ("\n\nHuman:",),
    }


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"messages": HELLO}, "'max_tokens' is required"),
        ({"messages": HELLO, "max_tokens": 4, "stop_sequences": ["a", 3]}, "'stop_sequences' must be"),
        ({"messages": HELLO, "max_tokens": True}, "'max_tokens' must be a whole number"),
        ({"messages": HELLO, "max_tokens": 4, "tools": [{"name": "f"}]}, r"tools\[0\]\.input_schema must be"),
        ({"messages": HELLO, "max_tokens": 4, "top_logprobs": 2}, "'top_logprobs' is not supported"),
    ],
)
def test_a_field_that_is_wrong_is_named_in_the_message(body, said) -> None:
    with pytest.raises(ApiError, match=said) as refused:
        messages_request(body, Limits())
    assert refused.value.status == 400


def test_why_a_reply_ended_in_anthropics_words() -> None:
    assert [message("msg_1", "tiny", finished(reason))["stop_reason"] for reason in ("eos", "max_new_tokens")] == [
        "end_turn",
        "max_tokens",
    ]
    assert message("msg_1", "tiny", finished("interrupted"))["stop_reason"] == "interrupted"  # not whole
    stopped = message("msg_1", "tiny", finished("stop_string", stop_string="END"))
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    assert message("msg_1", "tiny", finished("eos"))["stop_sequence"] is None
    whole = message("msg_1", "tiny", finished("eos"))
    assert whole["usage"] == {
        "input_tokens": 10,  # read for this request: Anthropic counts the cache apart
        "output_tokens": 3,
        "cache_read_input_tokens": 20,
        "cache_creation_input_tokens": 0,
    }
    assert whole["content"] == [{"type": "text", "text": "Hi."}]


def test_errors_take_anthropics_type_by_status() -> None:
    kinds = {
        status: error_body(ApiError(status, "said"))["error"]["type"] for status in (400, 401, 404, 413, 429, 500, 503)
    }
    assert kinds == {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
        500: "api_error",
        503: "overloaded_error",
    }
    assert error_body(ApiError(409, "busy")) == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "busy"},
    }


def test_tools_and_tool_blocks_are_read_into_the_chat_apis_shape_their_ids_as_the_turn_files_them() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    use = {"type": "tool_use", "id": "toolu_ab12", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_ab12", "content": [{"type": "text", "text": "Sunny"}]}
    body = {
        "max_tokens": 64,
        "tools": [{"name": "get_weather", "description": "The weather.", "input_schema": schema}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            *HELLO,
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
            {"role": "user", "content": [result]},
        ],
    }
    chat = messages_request(body, Limits())
    assert chat.tools == [
        {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": schema}}
    ]
    assert (chat.tool_choice, chat.parallel_tool_calls, chat.text) == ("required", False, "")
    call = {
        "id": "call_ab12",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    assert chat.history[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    assert chat.tool_results == [{"tool_call_id": "call_ab12", "content": "Sunny"}]


def test_a_reply_with_calls_is_its_text_then_tool_use_blocks() -> None:
    call = {"id": "call_ab12", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    done = finished("eos", 'Looking.<tool_call>{"name": ...}</tool_call>')
    done = Finished(**{**done.__dict__, "tool_calls": (call,), "content": "Looking."})
    said = message("msg_1", "tiny", done)
    assert said["stop_reason"] == "tool_use"
    assert said["content"] == [
        {"type": "text", "text": "Looking."},
        {"type": "tool_use", "id": "toolu_ab12", "name": "get_weather", "input": {"city": "Oslo"}},
    ]
