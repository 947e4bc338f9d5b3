"""Responses requests read into the chat API's ChatRequest, with or without the conversation they go on from."""

from __future__ import annotations

import pytest

from streamchat.cache.ledger import CacheStats
from streamchat.serve.apis.openai_responses import response, responses_request
from streamchat.serve.apis.request import ApiError, Limits
from streamchat.serve.turn import Finished

EARLIER = ("Be brief.", [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi."}])


def test_input_items_are_the_system_prompt_history_and_new_message() -> None:
    body = {
        "instructions": "Be brief.",
        "input": [
            {"role": "developer", "content": "Answer in English."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Hi "}, {"type": "input_text", "text": "there"}],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}],
            },
            {"role": "user", "content": "And now?"},
        ],
        "max_output_tokens": 64,
        "temperature": 0,
        "top_p": 0.5,
        "stream": True,
    }
    asked = responses_request(body, Limits())
    chat = asked.chat_request()
    assert chat.system == "Be brief.\n\nAnswer in English."
    assert chat.history == [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello."}]
    assert (chat.text, chat.stream) == ("And now?", True)
    assert chat.settings == {"max_new_tokens": 64, "temperature": 0.0, "top_p": 0.5}


def test_going_on_from_a_response_puts_its_conversation_first_and_keeps_its_instructions() -> None:
    asked = responses_request({"input": "And then?", "previous_response_id": "resp_x"}, Limits())
    chat = asked.chat_request(EARLIER)
    assert (chat.system, chat.history, chat.text) == ("Be brief.", EARLIER[1], "And then?")
    # Instructions given are the system prompt: a conversation under other instructions (the matcher starts one).
    other = responses_request({"input": "And then?", "instructions": "Be long."}, Limits()).chat_request(EARLIER)
    assert other.system == "Be long."
    assert responses_request({"input": "Hi"}, Limits()).chat_request().system is None  # the server's own


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": 3}}}, "text.format.schema"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x y"}}}, "text.format.name"),
        ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "strict": 1}}}, "text.format.strict"),
        ({"input": "Hi", "text": {"format": {"type": "json_object", "schema": {}}}}, "text.format.schema"),
        (
            {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "strin"}}}},
            "text.format.schema",
        ),
        ({"input": "Hi", "text": "plain"}, "text"),
        ({"input": "Hi", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Hi", "x": 1}]}]},
            "input[0].content[0].x",
        ),
    ],
)
def test_a_field_that_is_wrong_is_named(body, param) -> None:
    with pytest.raises(ApiError) as refused:
        responses_request(body, Limits())
    assert (refused.value.status, refused.value.param) == (400, param)
    assert param.split("[")[0] in refused.value.message


def test_a_response_is_complete_incomplete_or_in_progress() -> None:
    asked = responses_request({"input": "Hi", "max_output_tokens": 3, "metadata": {"a": "b"}}, Limits())

    def said(stop_reason: str | None) -> dict:
        ended = None if stop_reason is None else Finished("Hi.", stop_reason, 10, 3, 4, CacheStats(0, 4, 0, 64, 0, 0))
        return response("resp_1", 0, "tiny", asked, ended, "msg_1")

    assert [said(reason)["status"] for reason in (None, "eos", "stop_string", "max_new_tokens", "interrupted")] == [
        "in_progress",
        "completed",
        "completed",
        "incomplete",
        "incomplete",
    ]
    assert said("max_new_tokens")["incomplete_details"] == {"reason": "max_output_tokens"}
    assert said(None)["output"] == [] and said(None)["usage"] is None
    assert said("eos")["usage"] == {
        "input_tokens": 10,
        "input_tokens_details": {"cached_tokens": 4, "cache_write_tokens": 0},
        "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 13,
    }
    assert (said("eos")["max_output_tokens"], said("eos")["metadata"]) == (3, {"a": "b"})
