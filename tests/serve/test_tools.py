"""Tool calls over the chat completions API, through OpenAI's client against a real server on tiny models: the
calls read from a reply (whole and streamed), sent back with their results to continue the same conversation,
a reply held to a call (tool_choice "required"), and the requests refused."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest

from streamchat.conversation.message import tool_results_message
from streamchat.conversation.template import chat_format_for
from streamchat.serve.pool import NAMING_HEADER
from tests.serve.conftest import HELLO_BODY
from tests.support.tool_template import TIME_TOOL, WEATHER_TOOL, scripted_tool_model, tool_tokenizer

TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
UNIT_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tool_model() -> tuple[Any, Any]:
    return scripted_tool_model()


def test_a_reply_that_calls_a_tool_is_its_calls_and_the_results_continue_the_same_conversation(
    start_server, tool_model
):
    server = start_server(tool_model)
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=ASK, tools=TOOLS)
    reply = raw.parse()
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    conversation = raw.headers[NAMING_HEADER]

    called = choice.message.model_dump(exclude_none=True)
    result = {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}
    # "none": the tools are still described (the same conversation), the reply is text.
    then = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=[*ASK, called, result], tools=TOOLS, tool_choice="none"
    )
    assert then.headers[NAMING_HEADER] == conversation
    answer = then.parse()
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].message.content.startswith("<tool_call>")
    # Only the tool results were read: the rest was in the cache.
    chat_format = chat_format_for(tool_model[1], None, TOOLS)
    results = tool_results_message([{"tool_call_id": call.id, "content": "Sunny, 21 C"}])
    calls = [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}
    ]
    read = len(chat_format.tool_results_ids({"role": "assistant", "content": "", "tool_calls": calls}, results))
    usage = answer.usage
    assert usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens == read


def test_a_streamed_call_comes_as_tool_call_deltas_and_its_text_is_held_back(start_server, tool_model):
    server = start_server(tool_model)
    chunks = list(server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, stream=True))
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert "<tool_call>" not in content
    deltas = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert deltas[0].index == 0 and deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    arguments = "".join(delta.function.arguments or "" for delta in deltas)
    assert json.loads(arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Sent back, the call continues the conversation: its history matches what the stream told.
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": deltas[0].id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        ],
    }
    result = {"role": "tool", "tool_call_id": deltas[0].id, "content": "Rain"}
    then = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=[*ASK, called, result], tools=TOOLS
    )
    assert then.parse().usage.prompt_tokens_details.cached_tokens > 0
    assert then.parse().choices[0].finish_reason == "tool_calls"


def test_tool_choice_required_holds_a_random_model_to_a_call(start_server, endless):
    server = start_server((endless[0], tool_tokenizer()), window=256)
    reply = server.client.chat.completions.create(
        model="tiny", messages=ASK, tools=[UNIT_TOOL], tool_choice="required", parallel_tool_calls=False, max_tokens=120
    )
    (call,) = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "set_unit" and json.loads(call.function.arguments)["unit"] in ("celsius", "fahrenheit")


def test_a_template_that_does_not_describe_tools_is_a_400_naming_tools(start_server, scripted):
    server = start_server(scripted)
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS)
    assert refused.value.body["param"] == "tools"
    assert "does not describe tools" in refused.value.body["message"]


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": "get_weather"}, "tools"),
        (
            {"tools": [WEATHER_TOOL, TIME_TOOL, {"type": "function", "function": {"name": "a b"}}]},
            "tools[2].function.name",
        ),
        (
            {"tools": [WEATHER_TOOL, {"type": "function", "function": {"name": "x", "parameters": []}}]},
            "tools[1].function.parameters",
        ),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name"),
        ({"tools": [{**WEATHER_TOOL, "function": {"name": f"f{n}"}} for n in range(129)]}, "tools"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_1", "content": "x"}]}, "messages[1].role"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_9", "content": "x"},
                ]
            },
            "messages[2].tool_call_id",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}, *ASK]},
            "messages[2].role",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{**CALL, "function": {"name": "f", "arguments": {}}}],
                    },
                    *ASK,
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": "x"}, *ASK]},
            "messages[1].tool_calls",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [CALL]}]}, "messages"),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(start_server, scripted, changes, param):
    server = start_server(scripted)
    response = server.post({**HELLO_BODY, **changes})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_a_long_streamed_reply_with_tools_is_the_whole_replys_text(start_server, endless):
    # Text that may begin a call is held back only while it may: streamed, a long reply of text is the same text.
    server = start_server((endless[0], tool_tokenizer()), window=512)
    asked = {"model": "tiny", "messages": ASK, "tools": TOOLS, "max_tokens": 200}
    whole = server.client.chat.completions.create(**asked).choices[0].message.content
    chunks = list(server.client.chat.completions.create(**asked, stream=True))
    streamed = [chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices]
    assert len(whole) > 200 and "".join(streamed) == whole
    assert sum(1 for piece in streamed if piece) > 100  # sent as it came, not at the end
    claude = [{"name": tool["function"]["name"], "input_schema": tool["function"]["parameters"]} for tool in TOOLS]
    claude[0]["description"] = WEATHER_TOOL["function"]["description"]  # the same tools: the same prompt
    with server.anthropic.messages.stream(model="tiny", max_tokens=200, messages=ASK, tools=claude) as stream:
        assert "".join(stream.text_stream) == whole
