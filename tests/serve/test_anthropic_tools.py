"""Tool use over Anthropic's Messages API, through Anthropic's client against a real server on the tool template's
scripted model: the calls as tool_use blocks (whole and streamed), sent back with tool_result blocks to continue the
same conversation reading only the results, and the requests refused (400s naming the field)."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest

from streamchat.conversation.message import tool_results_message
from streamchat.conversation.template import chat_format_for
from streamchat.serve.pool import NAMING_HEADER
from tests.serve.test_tools import UNIT_TOOL
from tests.support.tool_template import TIME_TOOL, WEATHER_TOOL, scripted_tool_model, tool_tokenizer

# The tool template's tools, as Anthropic writes them.
TOOLS: list[dict[str, Any]] = [
    {
        "name": tool["function"]["name"],
        **({"description": tool["function"]["description"]} if "description" in tool["function"] else {}),
        "input_schema": tool["function"]["parameters"],
    }
    for tool in (WEATHER_TOOL, TIME_TOOL)
]
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model() -> tuple[Any, Any]:
    return scripted_tool_model()


def results_read(tool_model: tuple[Any, Any], call_id: str, result: str) -> int:
    """How many tokens a turn reads that hands the scripted call (filed under `call_id`) its `result`."""
    chat_format = chat_format_for(tool_model[1], None, [WEATHER_TOOL, TIME_TOOL])
    results = tool_results_message([{"tool_call_id": call_id, "content": result}])
    arguments = json.dumps({"city": "Paris"})
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return len(chat_format.tool_results_ids({"role": "assistant", "content": "", "tool_calls": [call]}, results))


def answered(tool_use_id: str, result: str) -> list[dict[str, Any]]:
    """The reply's call and its result, as a client sends them back."""
    called = {"type": "tool_use", "id": tool_use_id, "name": "get_weather", "input": {"city": "Paris"}}
    return [
        {"role": "assistant", "content": [called]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": result}]},
    ]


def test_a_call_is_a_tool_use_block_and_its_result_continues_the_same_conversation(start_server, tool_model):
    server = start_server(tool_model)
    raw = server.anthropic.messages.with_raw_response.create(model="tiny", max_tokens=40, messages=ASK, tools=TOOLS)
    reply = raw.parse()
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert block.type == "tool_use" and block.id.startswith("toolu_")
    assert (block.name, block.input) == ("get_weather", {"city": "Paris"})
    conversation = raw.headers[NAMING_HEADER]

    result = [{"type": "text", "text": "Sunny, "}, {"type": "text", "text": "21 C"}]
    history = [*ASK, {"role": "assistant", "content": [block.model_dump(exclude_none=True)]}]
    history.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": block.id, "content": result}]})
    # "none": the tools are still described (the same conversation), the reply is text.
    then = server.anthropic.messages.with_raw_response.create(
        model="tiny", max_tokens=40, messages=history, tools=TOOLS, tool_choice={"type": "none"}
    )
    assert then.headers[NAMING_HEADER] == conversation
    answer = then.parse()
    assert answer.stop_reason == "end_turn" and answer.content[0].text.startswith("<tool_call>")
    # Only the result was read, filed under the call's id as the Turn made it (call_<the same hex>).
    filed = "call_" + block.id.removeprefix("toolu_")
    assert answer.usage.input_tokens == results_read(tool_model, filed, "Sunny, 21 C")
    assert answer.usage.cache_read_input_tokens > 0

    # The chat API, sent the call under the id the Turn filed (and the reply to its result), goes on in it too.
    chat_call = {"id": filed, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = server.client.chat.completions.with_raw_response.create(
        model="tiny",
        messages=[
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [chat_call]},
            {"role": "tool", "tool_call_id": filed, "content": "Sunny, 21 C"},
            {"role": "assistant", "content": answer.content[0].text},
            {"role": "user", "content": "Thanks!"},
        ],
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice="none",
        max_tokens=40,
    )
    assert chat.headers[NAMING_HEADER] == conversation


def test_a_streamed_call_is_a_tool_use_block_of_input_json_deltas(start_server, tool_model):
    server = start_server(tool_model)
    with server.anthropic.messages.stream(model="tiny", max_tokens=40, messages=ASK, tools=TOOLS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events if event.type not in ("text", "input_json")]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    (block,) = final.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert block.id.startswith("toolu_") and final.stop_reason == "tool_use"

    then = server.anthropic.messages.create(
        model="tiny", max_tokens=40, messages=[*ASK, *answered(block.id, "Rain")], tools=TOOLS
    )
    filed = "call_" + block.id.removeprefix("toolu_")
    assert then.usage.input_tokens == results_read(tool_model, filed, "Rain")
    assert then.stop_reason == "tool_use" and then.content[0].id != block.id


def test_tool_choice_tool_holds_a_random_model_to_that_call(start_server, endless):
    server = start_server((endless[0], tool_tokenizer()), window=256)
    unit = UNIT_TOOL["function"]
    reply = server.anthropic.messages.create(
        model="tiny",
        max_tokens=120,
        messages=ASK,
        tools=[{"name": unit["name"], "input_schema": unit["parameters"]}],
        tool_choice={"type": "tool", "name": "set_unit", "disable_parallel_tool_use": True},
    )
    (block,) = reply.content
    assert (block.type, block.name, reply.stop_reason) == ("tool_use", "set_unit", "tool_use")
    assert block.input["unit"] in ("celsius", "fahrenheit")


def test_tools_on_a_template_that_does_not_describe_them_are_a_400_naming_tools(start_server, scripted):
    server = start_server(scripted)
    with pytest.raises(anthropic.BadRequestError, match="tools"):
        server.anthropic.messages.create(model="tiny", max_tokens=40, messages=ASK, tools=TOOLS)


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"tools": [{"name": "a b", "input_schema": {}}]}, "tools[0].name"),
        ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].name"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "launch"}}, "tool_choice.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"tools": [], "tool_choice": {"type": "any"}}, "tool_choice"),
        ({"messages": [{"role": "user", "content": [RESULT]}]}, "messages[0].content[0].tool_use_id"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [USE]},
                    {"role": "user", "content": [{**RESULT, "tool_use_id": "toolu_9"}]},
                ]
            },
            "messages[2].content[0].tool_use_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [{**USE, "input": "{}"}]},
                    {"role": "user", "content": [RESULT]},
                ]
            },
            "messages[1].content[0].input",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [{**USE, "id": "a b"}]},
                    {"role": "user", "content": [RESULT]},
                ]
            },
            "messages[1].content[0].id",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": [USE]}, *ASK]}, "messages[2].content"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [USE]},
                    {"role": "user", "content": [{"type": "text", "text": "and?"}, RESULT]},
                ]
            },
            "messages[2].content[1]",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [USE]},
                    {"role": "user", "content": [RESULT, RESULT]},
                ]
            },
            "messages[2].content[1].tool_use_id",
        ),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "content": [USE]},
                    {"role": "user", "content": [{**RESULT, "content": [{"type": "image"}]}]},
                ]
            },
            "messages[2].content[0].content[0]",
        ),
        ({"messages": [*ASK, {"role": "assistant", "content": [USE]}]}, "messages"),
        ({"messages": [{"role": "user", "content": [USE]}]}, "messages[0].content[0]"),
    ],
)
def test_bad_tool_use_is_a_400_in_anthropics_shape_naming_the_field(start_server, tool_model, changes, field):
    server = start_server(tool_model)
    body = {"model": "tiny", "max_tokens": 40, "messages": ASK, "tools": TOOLS, **changes}
    response = server.http.post(f"{server.url}/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert (error["type"], error["error"]["type"]) == ("error", "invalid_request_error")
    assert field in error["error"]["message"] and "\n" not in error["error"]["message"]
