"""POST /v1/responses through the openai client and raw HTTP: shapes, streams, previous_response_id, errors."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from streamchat.serve.apis.request import Limits
from streamchat.storage.session_file import read_session
from tests.serve.conftest import REPLY, wait_idle
from tests.serve.test_turn import new_turn_tokens

HELLO_BODY = {"model": "tiny", "input": "Hello!"}


def said(server, conversation: str) -> list[str]:
    return [message["content"] for message in read_session(server.sessions / f"{conversation}.jsonl").messages]


def test_a_whole_response_in_openai_shape(start_server, scripted) -> None:
    server = start_server(scripted)
    _, tokenizer = scripted
    raw = server.client.responses.with_raw_response.create(model="tiny", input="Hello!", store=False, user="ada")
    response = raw.parse()
    conversation = raw.headers["x-streamchat-conversation"]
    assert (response.object, response.status, response.model, response.incomplete_details) == (
        "response",
        "completed",
        "tiny",
        None,
    )
    assert response.id == f"resp_{conversation}_2"
    (message,) = response.output
    assert (message.type, message.role, message.status, message.id[:4]) == ("message", "assistant", "completed", "msg_")
    assert [(part.type, part.text, part.annotations) for part in message.content] == [("output_text", REPLY, [])]
    assert response.output_text == REPLY
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (
        new_turn_tokens(tokenizer, "Hello!", True),
        7,
        usage.input_tokens + 7,
    )
    assert (usage.input_tokens_details.cached_tokens, usage.output_tokens_details.reasoning_tokens) == (0, 0)
    assert response.user == "ada" and raw.headers["x-streamchat-cache"].endswith("evicted 0")
    assert said(server, conversation) == ["Hello!", REPLY]


def test_previous_response_id_goes_on_reading_only_the_new_message_and_survives_a_restart(
    start_server, scripted, tmp_path
) -> None:
    sessions = tmp_path / "kept"
    server = start_server(scripted, sessions=sessions)
    _, tokenizer = scripted
    first = server.client.responses.create(model="tiny", input="Hello!", instructions="Be brief.")
    second = server.client.responses.with_raw_response.create(
        model="tiny", input="And then?", previous_response_id=first.id
    )
    conversation = second.headers["x-streamchat-conversation"]
    assert first.id == f"resp_{conversation}_2" and second.parse().id == f"resp_{conversation}_4"
    usage = second.parse().usage
    read = usage.input_tokens - usage.input_tokens_details.cached_tokens
    assert read == new_turn_tokens(tokenizer, "And then?", False, "Be brief.")
    server.stop()  # every live conversation parked, its state written beside its journal
    again = start_server(scripted, sessions=sessions)
    third = again.client.responses.with_raw_response.create(
        model="tiny", input="Once more.", previous_response_id=second.parse().id
    )
    assert third.headers["x-streamchat-conversation"] == conversation
    usage = third.parse().usage
    read = usage.input_tokens - usage.input_tokens_details.cached_tokens
    assert read == new_turn_tokens(tokenizer, "Once more.", False, "Be brief.")  # restored exactly, not replayed
    saved = read_session(sessions / f"{conversation}.jsonl")
    assert saved.system_prompt == "Be brief."  # the instructions went on without being sent again
    assert [message["content"] for message in saved.messages] == [
        "Hello!",
        REPLY,
        "And then?",
        REPLY,
        "Once more.",
        REPLY,
    ]


def test_a_response_branches_from_an_older_one_into_a_conversation_of_its_own(start_server, scripted) -> None:
    server = start_server(scripted)
    first = server.client.responses.with_raw_response.create(model="tiny", input="Hello!")
    conversation = first.headers["x-streamchat-conversation"]
    server.client.responses.create(model="tiny", input="Left.", previous_response_id=first.parse().id)
    branch = server.client.responses.with_raw_response.create(
        model="tiny", input="Right.", previous_response_id=first.parse().id
    )
    other = branch.headers["x-streamchat-conversation"]
    assert other != conversation and branch.parse().id == f"resp_{other}_4"
    assert said(server, conversation) == ["Hello!", REPLY, "Left.", REPLY]
    assert said(server, other) == ["Hello!", REPLY, "Right.", REPLY]
    usage = branch.parse().usage  # the history replayed: all of it read but the 4 sinks the first one read
    assert usage.input_tokens_details.cached_tokens == 4


def test_input_items_resent_whole_continue_the_conversation(start_server, scripted) -> None:
    server = start_server(scripted)
    first = server.client.responses.with_raw_response.create(
        model="tiny", input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    )
    conversation = first.headers["x-streamchat-conversation"]
    fed_back = first.parse().output[0].model_dump(exclude_none=True)  # as a client keeps the output items
    items = [
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Be brief."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hello!"}]},
        fed_back,
        {"role": "user", "content": "And then?"},
    ]
    again = server.client.responses.with_raw_response.create(model="tiny", input=items)
    assert again.headers["x-streamchat-conversation"] == conversation
    assert again.parse().id == f"resp_{conversation}_4"


def test_a_streamed_response_is_openais_events_in_order(start_server, scripted) -> None:
    server = start_server(scripted)
    events = list(server.client.responses.create(model="tiny", input="Hello!", stream=True))
    kinds = [event.type for event in events]
    deltas = len(kinds) - 8
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert "".join(event.delta for event in events[4:-4]) == events[-4].text == REPLY
    done = events[-1].response
    assert (done.status, done.output_text, done.usage.output_tokens) == ("completed", REPLY, 7)
    assert done.id == events[0].response.id and done.id.startswith("resp_")
    # The SDK's stream helper reads it too, and the response goes on from it.
    with server.client.responses.stream(model="tiny", input="And then?", previous_response_id=done.id) as stream:
        text = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == REPLY
    assert final.id == done.id.rsplit("_", 1)[0] + "_4"


def test_a_response_cut_at_max_output_tokens_is_incomplete(start_server, scripted) -> None:
    server = start_server(scripted)
    short = server.client.responses.create(model="tiny", input="Hello!", max_output_tokens=3, temperature=0, top_p=1)
    assert (short.status, short.incomplete_details.reason, short.output_text) == (
        "incomplete",
        "max_output_tokens",
        "Sure: the",
    )
    assert (short.output[0].status, short.max_output_tokens, short.temperature) == ("incomplete", 3, 0)
    events = list(server.client.responses.create(model="tiny", input="Hello!", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


BAD_REQUESTS = [
    ({"model": "tiny"}, "input"),
    ({**HELLO_BODY, "input": 3}, "input"),
    ({**HELLO_BODY, "input": []}, "input"),
    ({**HELLO_BODY, "input": [{"role": "assistant", "content": "Hi"}]}, "input[0].role"),
    ({**HELLO_BODY, "input": [{"role": "user", "content": "Hi"}, {"role": "user", "content": "Hi"}]}, "input[1].role"),
    ({**HELLO_BODY, "input": [{"role": "tool", "content": "Hi"}]}, "input[0].role"),
    ({**HELLO_BODY, "input": [{"role": "user", "content": 3}]}, "input[0].content"),
    ({**HELLO_BODY, "input": [{"role": "user", "content": "Hi", "name": "ada"}]}, "input[0].name"),
    ({**HELLO_BODY, "input": ["Hi"]}, "input[0]"),
    (
        {**HELLO_BODY, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        "input[0].content[0]",
    ),
    ({**HELLO_BODY, "input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].call_id"),
    ({**HELLO_BODY, "input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    (
        {**HELLO_BODY, "input": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late."}]},
        "input[1].role",
    ),
    ({**HELLO_BODY, "instructions": ["Be brief."]}, "instructions"),
    ({**HELLO_BODY, "max_output_tokens": 0}, "max_output_tokens"),
    ({**HELLO_BODY, "temperature": "hot"}, "temperature"),
    ({**HELLO_BODY, "top_p": 0}, "top_p"),
    ({**HELLO_BODY, "stream": 1}, "stream"),
    ({**HELLO_BODY, "tools": [{"type": "function", "name": "f"}]}, "tools"),
    ({**HELLO_BODY, "reasoning": {"effort": "high"}}, "reasoning"),
    ({**HELLO_BODY, "text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format.schema"),
    ({**HELLO_BODY, "text": {"verbosity": "low"}}, "text.verbosity"),
    ({**HELLO_BODY, "seed": 3}, "seed"),
    ({**HELLO_BODY, "previous_response_id": 3}, "previous_response_id"),
    ({**HELLO_BODY, "previous_response_id": "resp_abc"}, "previous_response_id"),
    ({**HELLO_BODY, "previous_response_id": "resp_20250101-120000-3fa2c1_3"}, "previous_response_id"),
    ({**HELLO_BODY, "previous_response_id": "resp_20250101-120000-3fa2c1_0"}, "previous_response_id"),
    ({**HELLO_BODY, "previous_response_id": "resp_../../etc/passwd_2"}, "previous_response_id"),
]


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS)
def test_a_bad_field_is_a_400_naming_it(start_server, scripted, body, param) -> None:
    server = start_server(scripted)
    response = server.http.post(f"{server.url}/v1/responses", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["param"], error["type"], set(error)) == (
        param,
        "invalid_request_error",
        {"message", "type", "param", "code"},
    )
    assert "\n" not in error["message"]


def test_an_unknown_previous_response_is_a_404_and_neutral_fields_are_accepted(start_server, scripted) -> None:
    server = start_server(scripted, limits=Limits(body_bytes=3000, messages=3, message_chars=100))
    first = server.client.responses.create(model="tiny", input="Hello!")
    conversation = first.id.removeprefix("resp_").rsplit("_", 1)[0]
    for unknown in ("resp_20250101-120000-3fa2c1_2", f"resp_{conversation}_6"):
        with pytest.raises(openai.NotFoundError) as missing:
            server.client.responses.create(model="tiny", input="Hi", previous_response_id=unknown)
        assert missing.value.body["param"] == "previous_response_id" and unknown in missing.value.body["message"]
    with pytest.raises(openai.BadRequestError, match="longer than 100"):
        server.client.responses.create(model="tiny", input="x" * 101)
    with pytest.raises(openai.BadRequestError, match="at most 3"):
        server.client.responses.create(model="tiny", input=[{"role": "user", "content": "Hi"}] * 4)
    huge = server.http.post(f"{server.url}/v1/responses", json={"input": "x" * 4000})
    assert huge.status_code == 413
    neutral = {
        "store": False,
        "metadata": {"app": "test"},
        "tools": [],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "text": {"format": {"type": "text"}},
        "reasoning": None,
    }
    response = server.http.post(f"{server.url}/v1/responses", json={**HELLO_BODY, **neutral})
    assert (response.status_code, response.json()["metadata"]) == (200, {"app": "test"})


def test_a_client_that_leaves_a_stream_stops_its_response(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1, max_waiting=0)
    body = {**HELLO_BODY, "max_output_tokens": 10**6, "stream": True}
    with server.http.stream("POST", f"{server.url}/v1/responses", json=body) as response:
        conversation = response.headers["x-streamchat-conversation"]
        lines = response.iter_lines()
        next(line for line in lines if "output_text.delta" in line)
        full = server.http.post(f"{server.url}/v1/responses", json=HELLO_BODY)
        assert (full.status_code, full.json()["error"]["code"]) == (429, "busy")
    wait_idle(server)  # a million tokens: only a stop ends it
    last = json.loads((server.sessions / f"{conversation}.jsonl").read_text().splitlines()[-1])
    assert (last["type"], last["stop_reason"]) == ("reply", "interrupted")


CHOICE = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "pick": {"enum": ["left", "right"]}},
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def test_text_format_holds_the_response_to_a_json_schema_whole_and_streamed(start_server, endless) -> None:
    server = start_server(endless)
    text_format = {"type": "json_schema", "name": "choice", "schema": CHOICE, "strict": True}
    asked = {"model": "tiny", "max_output_tokens": 60, "text": {"format": text_format}}
    whole = server.client.responses.create(input="Left or right?", **asked)
    jsonschema.validate(json.loads(whole.output_text), CHOICE)
    assert whole.status == "completed" and whole.text.format.type == "json_schema"
    streamed = server.client.responses.create(input="Again?", stream=True, **asked)
    said = "".join(event.delta for event in streamed if event.type == "response.output_text.delta")
    jsonschema.validate(json.loads(said), CHOICE)
    any_object = {"type": "json_object"}
    assert server.client.responses.create(model="tiny", input="Hi", text={"format": any_object}).output_text[0] == "{"
