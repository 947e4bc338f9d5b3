"""Tool results and the user's words in one new input (what agents such as Claude Code send: the results, then a
reminder), through each API's own client against a real server on the tool template's scripted model: one prompt
turn (the results fed, then the user's text), one reply, journaled as one tool entry, and a resend of the whole
history after it reads only its new message. And an Anthropic tool_result's `is_error`, said to the model."""

from __future__ import annotations

import json
from typing import Any

import pytest

from streamchat.conversation.message import Message, tool_results_message
from streamchat.conversation.template import chat_format_for
from streamchat.serve.pool import NAMING_HEADER
from streamchat.storage.session_file import read_session
from tests.serve.test_anthropic_tools import TOOLS as CLAUDE_TOOLS
from tests.serve.test_responses_tools import TOOLS as FLAT_TOOLS
from tests.support.tool_template import TIME_TOOL, WEATHER_TOOL, scripted_tool_model

TOOLS = [WEATHER_TOOL, TIME_TOOL]
ASK = "Weather in Paris?"
REMINDER = "Answer in one word."
THANKS = "Thanks!"
ARGUMENTS = json.dumps({"city": "Paris"})


@pytest.fixture(scope="module")
def tool_model() -> tuple[Any, Any]:
    return scripted_tool_model()


def called(call_id: str) -> Message:
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}  # type: ignore[typeddict-item]


def turn_read(tool_model: tuple[Any, Any], call_id: str, result: str, text: str) -> int:
    """How many tokens a turn reads that hands the scripted call (filed under `call_id`) its `result`, then `text`."""
    chat_format = chat_format_for(tool_model[1], None, TOOLS)
    results = tool_results_message([{"tool_call_id": call_id, "content": result}], text)
    return len(chat_format.tool_results_ids(called(call_id), results))


def message_read(tool_model: tuple[Any, Any], text: str) -> int:
    """How many tokens a later user message reads."""
    return len(chat_format_for(tool_model[1], None, TOOLS).prompt_ids(text, first_turn=False))


def journaled(server: Any, conversation: str) -> list[Message]:
    return read_session(server.sessions / f"{conversation}.jsonl").messages


def claude_called(server: Any) -> tuple[list[dict[str, Any]], Any, str]:
    """The question through the Anthropic client, the scripted model's tool_use block answering it, and the
    conversation it was filed under."""
    ask = [{"role": "user", "content": ASK}]
    raw = server.anthropic.messages.with_raw_response.create(
        model="tiny", max_tokens=40, messages=ask, tools=CLAUDE_TOOLS
    )
    (block,) = raw.parse().content
    return ask, block, raw.headers[NAMING_HEADER]


def test_anthropic_tool_results_then_text_are_one_turn_and_a_resend_reads_only_its_new_message(
    start_server, tool_model
):
    server = start_server(tool_model)
    ask, block, conversation = claude_called(server)
    result = {"type": "tool_result", "tool_use_id": block.id, "content": "Sunny"}
    history = [
        *ask,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {"role": "user", "content": [result, {"type": "text", "text": REMINDER}]},
    ]
    then = server.anthropic.messages.with_raw_response.create(
        model="tiny", max_tokens=40, messages=history, tools=CLAUDE_TOOLS, tool_choice={"type": "none"}
    )
    assert then.headers[NAMING_HEADER] == conversation
    answer = then.parse()
    filed = "call_" + block.id.removeprefix("toolu_")
    # The results, then the text: read in one turn, from the cache's end.
    assert answer.usage.input_tokens == turn_read(tool_model, filed, "Sunny", REMINDER)
    (text,) = answer.content
    messages = journaled(server, conversation)
    assert [message["role"] for message in messages] == ["user", "assistant", "tool", "assistant"]  # one reply
    assert messages[2]["tool_results"] == [{"tool_call_id": filed, "content": "Sunny"}]
    assert messages[2]["user_text"] == REMINDER and messages[3]["content"] == text.text

    # The whole history resent with a new message: the same conversation, only the new message read.
    again = server.anthropic.messages.with_raw_response.create(
        model="tiny",
        max_tokens=40,
        messages=[*history, {"role": "assistant", "content": text.text}, {"role": "user", "content": THANKS}],
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "none"},
    )
    assert again.headers[NAMING_HEADER] == conversation
    assert again.parse().usage.input_tokens == message_read(tool_model, THANKS)
    assert len(journaled(server, conversation)) == 6


def test_anthropic_is_error_is_said_in_the_result_the_model_reads(start_server, tool_model):
    server = start_server(tool_model)
    ask, block, conversation = claude_called(server)
    failed = {"type": "tool_result", "tool_use_id": block.id, "content": "no such city", "is_error": True}
    history = [
        *ask,
        {"role": "assistant", "content": [block.model_dump(exclude_none=True)]},
        {"role": "user", "content": [failed]},
    ]
    answer = server.anthropic.messages.create(
        model="tiny", max_tokens=40, messages=history, tools=CLAUDE_TOOLS, tool_choice={"type": "none"}
    )
    filed = "call_" + block.id.removeprefix("toolu_")
    assert answer.usage.input_tokens == turn_read(tool_model, filed, "Error: no such city", "")
    messages = journaled(server, conversation)
    assert messages[2]["tool_results"] == [{"tool_call_id": filed, "content": "Error: no such city"}]
    # Resent as it was, the error reads the same: the history matches, only the new message is read.
    again = server.anthropic.messages.with_raw_response.create(
        model="tiny",
        max_tokens=40,
        messages=[*history, {"role": "assistant", "content": answer.content[0].text}, {"role": "user", "content": "?"}],
        tools=CLAUDE_TOOLS,
        tool_choice={"type": "none"},
    )
    assert again.headers[NAMING_HEADER] == conversation
    assert again.parse().usage.input_tokens == message_read(tool_model, "?")


def test_chat_tool_messages_then_a_user_message_are_one_turn(start_server, tool_model):
    server = start_server(tool_model)
    ask = [{"role": "user", "content": ASK}]
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=ask, tools=TOOLS)
    message = raw.parse().choices[0].message
    conversation = raw.headers[NAMING_HEADER]
    (call,) = message.tool_calls
    history = [
        *ask,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny"},
        {"role": "user", "content": REMINDER},
    ]
    then = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=history, tools=TOOLS, tool_choice="none"
    )
    assert then.headers[NAMING_HEADER] == conversation
    answer = then.parse()
    used = answer.usage
    assert used.prompt_tokens - used.prompt_tokens_details.cached_tokens == turn_read(
        tool_model, call.id, "Sunny", REMINDER
    )
    messages = journaled(server, conversation)
    assert [message["role"] for message in messages] == ["user", "assistant", "tool", "assistant"]
    assert messages[2]["user_text"] == REMINDER

    reply = {"role": "assistant", "content": answer.choices[0].message.content}
    again = server.client.chat.completions.with_raw_response.create(
        model="tiny", messages=[*history, reply, {"role": "user", "content": THANKS}], tools=TOOLS, tool_choice="none"
    )
    assert again.headers[NAMING_HEADER] == conversation
    used = again.parse().usage
    assert used.prompt_tokens - used.prompt_tokens_details.cached_tokens == message_read(tool_model, THANKS)


def test_responses_outputs_then_a_user_message_are_one_turn(start_server, tool_model):
    server = start_server(tool_model)
    raw = server.client.responses.with_raw_response.create(model="tiny", input=ASK, tools=FLAT_TOOLS)
    (call,) = raw.parse().output
    conversation = raw.headers[NAMING_HEADER]
    items = [
        {"role": "user", "content": ASK},
        call.model_dump(),
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
        {"role": "user", "content": REMINDER},
    ]
    then = server.client.responses.with_raw_response.create(
        model="tiny", input=items, tools=FLAT_TOOLS, tool_choice="none"
    )
    assert then.headers[NAMING_HEADER] == conversation
    answer = then.parse()
    assert answer.id == f"resp_{conversation}_4"  # one reply
    used = answer.usage
    assert used.input_tokens - used.input_tokens_details.cached_tokens == turn_read(
        tool_model, call.call_id, "Sunny", REMINDER
    )
    assert journaled(server, conversation)[2]["user_text"] == REMINDER

    said = [*items, {"role": "assistant", "content": answer.output_text}, {"role": "user", "content": THANKS}]
    again = server.client.responses.with_raw_response.create(
        model="tiny", input=said, tools=FLAT_TOOLS, tool_choice="none"
    )
    assert again.headers[NAMING_HEADER] == conversation
    used = again.parse().usage
    assert used.input_tokens - used.input_tokens_details.cached_tokens == message_read(tool_model, THANKS)


def test_responses_outputs_then_a_user_message_after_previous_response_id(start_server, tool_model):
    server = start_server(tool_model)
    first = server.client.responses.create(model="tiny", input=ASK, tools=FLAT_TOOLS)
    (call,) = first.output
    answer = server.client.responses.create(
        model="tiny",
        input=[
            {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny"},
            {"role": "user", "content": REMINDER},
        ],
        previous_response_id=first.id,
        tools=FLAT_TOOLS,
    )
    conversation = first.id.removeprefix("resp_").rsplit("_", 1)[0]
    assert answer.id == f"resp_{conversation}_4"
    used = answer.usage
    assert used.input_tokens - used.input_tokens_details.cached_tokens == turn_read(
        tool_model, call.call_id, "Sunny", REMINDER
    )


USE = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "x"}
TEXT = {"type": "text", "text": "and?"}


@pytest.mark.parametrize(
    ("content", "field"),
    [
        ([TEXT, RESULT], "messages[2].content[1]"),  # as Anthropic's API: the results come first
        ([RESULT, TEXT, RESULT], "messages[2].content[2]"),
        ([RESULT, {"type": "image"}], "messages[2].content[1]"),
    ],
)
def test_anthropic_text_before_a_tool_result_is_a_400_naming_it(start_server, tool_model, content, field):
    server = start_server(tool_model)
    messages = [{"role": "user", "content": ASK}, {"role": "assistant", "content": [USE]}]
    body = {"model": "tiny", "max_tokens": 40, "tools": CLAUDE_TOOLS}
    response = server.http.post(
        f"{server.url}/v1/messages", json={**body, "messages": [*messages, {"role": "user", "content": content}]}
    )
    assert response.status_code == 400, response.text
    error = response.json()
    assert (error["type"], error["error"]["type"]) == ("error", "invalid_request_error")
    assert field in error["error"]["message"] and "\n" not in error["error"]["message"]


def test_responses_an_output_after_the_user_message_is_a_400_naming_it(start_server, tool_model):
    server = start_server(tool_model)
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"}
    given = [
        {"role": "user", "content": ASK},
        call,
        {"type": "function_call_output", "call_id": "call_1", "output": "x"},
        {"role": "user", "content": REMINDER},
        {"type": "function_call_output", "call_id": "call_1", "output": "y"},
    ]
    response = server.http.post(
        f"{server.url}/v1/responses", json={"model": "tiny", "input": given, "tools": FLAT_TOOLS}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "input[4]"
