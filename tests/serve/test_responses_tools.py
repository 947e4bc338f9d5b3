"""Function calling over the Responses API, through OpenAI's client against a real server on the tool template's
scripted model: the calls as function_call items (whole and streamed), sent back as input items or after
previous_response_id with their function_call_output items to continue the same conversation reading only the
results, and the requests refused (400s naming the field, in OpenAI's error shape)."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from streamchat.serve.pool import NAMING_HEADER
from streamchat.storage.session_file import read_session
from tests.serve.test_anthropic_tools import results_read
from tests.support.tool_template import CALL_PIECES, TIME_TOOL, WEATHER_TOOL, scripted_tool_model

# The tool template's tools, flat, as the Responses API writes them.
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "strict": None, **tool["function"]} for tool in (WEATHER_TOOL, TIME_TOOL)
]
ASK = "Weather in Paris?"


@pytest.fixture(scope="module")
def tool_model() -> tuple[Any, Any]:
    return scripted_tool_model()


def output(call_id: str, result: str) -> dict[str, Any]:
    return {"type": "function_call_output", "call_id": call_id, "output": result}


def test_a_call_is_a_function_call_item_and_its_output_continues_the_same_conversation(start_server, tool_model):
    server = start_server(tool_model)
    raw = server.client.responses.with_raw_response.create(model="tiny", input=ASK, tools=TOOLS)
    response = raw.parse()
    conversation = raw.headers[NAMING_HEADER]
    assert (response.status, response.id) == ("completed", f"resp_{conversation}_2")
    (call,) = response.output
    assert (call.type, call.name, call.arguments, call.status) == (
        "function_call",
        "get_weather",
        '{"city": "Paris"}',
        "completed",
    )
    assert call.call_id.startswith("call_") and call.id == "fc_" + call.call_id.removeprefix("call_")
    assert [tool.name for tool in response.tools] == ["get_weather", "get_time"]
    assert (response.tool_choice, response.parallel_tool_calls) == ("auto", True)

    # The output items fed back as they came (the openai SDK's way), then the call's output.
    items = [{"role": "user", "content": ASK}, *[item.model_dump() for item in response.output]]
    then = server.client.responses.with_raw_response.create(
        model="tiny", input=[*items, output(call.call_id, "Sunny")], tools=TOOLS, tool_choice="none"
    )
    assert then.headers[NAMING_HEADER] == conversation
    answer = then.parse()
    assert answer.id == f"resp_{conversation}_4" and answer.output_text.startswith("<tool_call>")
    used = answer.usage
    assert used.input_tokens - used.input_tokens_details.cached_tokens == results_read(
        tool_model, call.call_id, "Sunny"
    )
    messages = read_session(server.sessions / f"{conversation}.jsonl").messages
    assert [message["role"] for message in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[1]["tool_calls"][0]["id"] == call.call_id
    assert messages[2]["tool_results"] == [{"tool_call_id": call.call_id, "content": "Sunny"}]


def test_a_streamed_call_and_previous_response_id_with_outputs_alone(start_server):
    model = scripted_tool_model(("Let me look. ", *CALL_PIECES))
    server = start_server(model)
    events = list(server.client.responses.create(model="tiny", input=ASK, tools=TOOLS, stream=True))
    kinds = [event.type for event in events if event.type != "response.output_text.delta"]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    sent = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert sent.rstrip() == "Let me look."  # the blank before the call was sent before the call began
    final = events[-1].response
    message, call = final.output
    assert (message.type, message.content[0].text, call.type, call.arguments) == (
        "message",
        "Let me look.",
        "function_call",
        '{"city": "Paris"}',
    )
    added = next(event for event in events if event.type == "response.output_item.added" and event.output_index == 1)
    assert (added.item.arguments, added.item.call_id) == ("", call.call_id)

    # With the client's stream helper too: the SDK accumulates the same response.
    with server.client.responses.stream(model="tiny", input=ASK, tools=TOOLS) as stream:
        helped = stream.get_final_response()
    assert [item.type for item in helped.output] == ["message", "function_call"]

    # Going on from the first response: the outputs alone are the new input, read as the conversation's results.
    raw = server.client.responses.with_raw_response.create(
        model="tiny", input=[output(call.call_id, "Rain")], previous_response_id=final.id, tools=TOOLS
    )
    conversation = final.id.removeprefix("resp_").rsplit("_", 1)[0]
    assert raw.headers[NAMING_HEADER] == conversation
    then = raw.parse()
    assert then.id == f"resp_{conversation}_4" and then.output[-1].type == "function_call"
    assert then.output[-1].call_id != call.call_id
    messages = read_session(server.sessions / f"{conversation}.jsonl").messages
    assert [message["role"] for message in messages] == ["user", "assistant", "tool", "assistant"]
    # And on again from there: its outputs, a reply of text.
    again = server.client.responses.create(
        model="tiny",
        input=[output(then.output[-1].call_id, "Fog")],
        previous_response_id=then.id,
        tools=TOOLS,
        tool_choice="none",
    )
    assert again.id == f"resp_{conversation}_6" and again.output[0].type == "message"


CALL = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
USER = {"role": "user", "content": ASK}
BAD = [
    ({"tools": {"name": "f"}}, "tools"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f", "extra": 1}]}, "tools[0].extra"),
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"input": [USER, {**CALL, "arguments": 3}, output("call_1", "x")]}, "input[1].arguments"),
    ({"input": [USER, CALL, output("call_2", "x")]}, "input[2].call_id"),
    ({"input": [USER, CALL, output("call_1", "x"), output("call_1", "y")]}, "input[3].call_id"),
    ({"input": [USER, CALL, {**CALL, "call_id": "call_2"}, output("call_1", "x")]}, "input[3]"),
    ({"input": [USER, CALL, USER]}, "input[2]"),
    ({"input": [USER, CALL]}, "input"),
    ({"input": [USER, output("call_1", "x")]}, "input[1].call_id"),
    ({"input": [USER, CALL, output("call_1", 3)]}, "input[2].output"),
    ({"input": [USER, CALL, {**output("call_1", "x"), "call_id": None}]}, "input[2].call_id"),
]


@pytest.mark.parametrize(("changes", "field"), BAD)
def test_a_bad_tool_field_is_a_400_naming_it(start_server, tool_model, changes, field):
    server = start_server(tool_model)
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.responses.create(**{"model": "tiny", "input": ASK, "tools": TOOLS, **changes})
    error = refused.value.body
    assert (error["param"], error["type"]) == (field, "invalid_request_error")
    assert field.split("[")[0] in error["message"]


def test_outputs_that_answer_no_call_of_the_previous_response_are_a_400(start_server, tool_model):
    server = start_server(tool_model)
    first = server.client.responses.create(model="tiny", input=ASK, tools=TOOLS)
    for given, field in (
        ([output("call_0", "x")], "input[0].call_id"),
        ([USER], "input"),
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            server.client.responses.create(model="tiny", input=given, previous_response_id=first.id, tools=TOOLS)
        assert refused.value.body["param"] == field


def test_tools_on_a_template_that_does_not_describe_them_are_a_400_naming_tools(start_server, scripted):
    server = start_server(scripted)
    with pytest.raises(openai.BadRequestError) as refused:
        server.client.responses.create(model="tiny", input=ASK, tools=TOOLS)
    assert refused.value.body["param"] == "tools"
