"""POST /v1/messages through Anthropic's own client and raw HTTP: shapes, streams, the same conversations, errors."""

from __future__ import annotations

import json
import socket

import anthropic
import pytest

from streamchat.serve.apis.request import Limits
from streamchat.storage.session_file import read_session
from tests.serve.conftest import REPLY, raw_request, wait_idle
from tests.serve.test_turn import new_turn_tokens
from tests.support.waiting import wait_until

HELLO = [{"role": "user", "content": "Hello!"}]
HELLO_BODY = {"model": "tiny", "max_tokens": 40, "messages": HELLO}


def test_a_whole_reply_in_anthropic_shape_journaled_and_continued_reading_only_the_new_message(
    start_server, scripted
) -> None:
    server = start_server(scripted)
    _, tokenizer = scripted
    raw = server.anthropic.messages.with_raw_response.create(model="tiny", max_tokens=40, messages=HELLO)
    reply = raw.parse()
    conversation = raw.headers["x-streamchat-conversation"]
    assert (reply.type, reply.role, reply.model, reply.id[:4]) == ("message", "assistant", "tiny", "msg_")
    assert [(block.type, block.text) for block in reply.content] == [("text", REPLY)]
    assert (reply.stop_reason, reply.stop_sequence) == ("end_turn", None)
    first_turn = new_turn_tokens(tokenizer, "Hello!", True)
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.cache_read_input_tokens) == (
        first_turn,
        7,
        0,
    )
    assert raw.headers["x-streamchat-cache"].endswith("evicted 0")
    # Resent whole, as Anthropic's clients do: the same conversation, only the new message read.
    answered = {"role": "assistant", "content": [{"type": "text", "text": reply.content[0].text}]}
    history = [*HELLO, answered, {"role": "user", "content": "And then?"}]
    again = server.anthropic.messages.with_raw_response.create(model="tiny", max_tokens=40, messages=history)
    assert again.headers["x-streamchat-conversation"] == conversation
    usage = again.parse().usage
    assert usage.input_tokens == new_turn_tokens(tokenizer, "And then?", False)
    assert usage.cache_read_input_tokens > first_turn
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert [message["content"] for message in saved.messages] == ["Hello!", REPLY, "And then?", REPLY]


def test_one_conversation_goes_on_through_every_api(start_server, scripted) -> None:
    server = start_server(scripted)
    raw = server.anthropic.messages.with_raw_response.create(
        model="tiny", max_tokens=40, system=[{"type": "text", "text": "Be brief."}], messages=HELLO
    )
    conversation = raw.headers["x-streamchat-conversation"]
    chat = [
        {"role": "system", "content": "Be brief."},
        *HELLO,
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "Go on."},
    ]
    via_chat = server.client.chat.completions.with_raw_response.create(model="tiny", messages=chat)
    assert via_chat.headers["x-streamchat-conversation"] == conversation
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert (saved.system_prompt, len(saved.messages)) == ("Be brief.", 4)


def test_a_streamed_reply_is_anthropics_events_in_order(start_server, scripted) -> None:
    server = start_server(scripted)
    with server.http.stream("POST", f"{server.url}/v1/messages", json={**HELLO_BODY, "stream": True}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-streamchat-conversation"]
        lines = [line for line in response.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines[::2]]
    events = [json.loads(line.removeprefix("data: ")) for line in lines[1::2]]
    assert [event["type"] for event in events] == names
    deltas = len(names) - 6
    assert names == [
        "message_start",
        "content_block_start",
        "ping",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    assert "".join(event["delta"]["text"] for event in events[3:-3]) == REPLY
    assert events[-2]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert events[-2]["usage"]["output_tokens"] == 7
    # Anthropic's client reads the same stream.
    with server.anthropic.messages.stream(model="tiny", max_tokens=40, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == REPLY
    assert (final.stop_reason, final.usage.output_tokens) == ("end_turn", 7)
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens > 0


def test_why_a_reply_ended_stop_sequences_and_max_tokens(start_server, scripted) -> None:
    server = start_server(scripted)
    one = server.anthropic.messages.create(model="tiny", max_tokens=40, messages=HELLO, stop_sequences=[" answer"])
    assert (one.content[0].text, one.stop_reason, one.stop_sequence) == ("Sure: the", "stop_sequence", " answer")
    # With several, the one that matched first in the reply's text.
    two = server.anthropic.messages.create(model="tiny", max_tokens=40, messages=HELLO, stop_sequences=["42", " is"])
    assert (two.content[0].text, two.stop_reason, two.stop_sequence) == ("Sure: the answer", "stop_sequence", " is")
    # This client sends no sampling settings of its own (2.17 dropped them): they go as extra fields.
    short = server.anthropic.messages.create(
        model="tiny", max_tokens=3, messages=HELLO, extra_body={"temperature": 0, "top_p": 1, "top_k": 5}
    )
    assert (short.content[0].text, short.stop_reason, short.usage.output_tokens) == ("Sure: the", "max_tokens", 3)
    with server.anthropic.messages.stream(
        model="tiny", max_tokens=40, messages=HELLO, stop_sequences=[" answer"]
    ) as stream:
        final = stream.get_final_message()
    assert (final.content[0].text, final.stop_reason, final.stop_sequence) == ("Sure: the", "stop_sequence", " answer")


BAD_REQUESTS = [
    ({"model": "tiny", "messages": HELLO}, "max_tokens"),
    ({**HELLO_BODY, "max_tokens": 0}, "max_tokens"),
    ({**HELLO_BODY, "max_tokens": "40"}, "max_tokens"),
    ({**HELLO_BODY, "temperature": -1}, "temperature"),
    ({**HELLO_BODY, "top_k": 1.5}, "top_k"),
    ({**HELLO_BODY, "stop_sequences": [""]}, "stop_sequences"),
    ({**HELLO_BODY, "stop_sequences": 3}, "stop_sequences"),
    ({**HELLO_BODY, "stream": "yes"}, "stream"),
    ({**HELLO_BODY, "model": 3}, "model"),
    ({**HELLO_BODY, "tools": [{"name": "f", "input_schema": {"type": "object"}}]}, "tools"),
    ({**HELLO_BODY, "tool_choice": {"type": "any"}}, "tool_choice"),
    ({**HELLO_BODY, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({**HELLO_BODY, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({**HELLO_BODY, "system": 3}, "system"),
    ({**HELLO_BODY, "system": [{"type": "image"}]}, "system[0]"),
    ({**HELLO_BODY, "messages": []}, "messages"),
    ({**HELLO_BODY, "messages": "Hello!"}, "messages"),
    ({**HELLO_BODY, "messages": [{"role": "assistant", "content": "Hi"}]}, "messages[0].role"),
    ({**HELLO_BODY, "messages": [*HELLO, *HELLO]}, "messages[1].role"),
    ({**HELLO_BODY, "messages": [*HELLO, {"role": "assistant", "content": "Su"}]}, "messages"),
    ({**HELLO_BODY, "messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({**HELLO_BODY, "messages": [{"role": "user", "content": "Hi", "name": "ada"}]}, "messages[0].name"),
    (
        {**HELLO_BODY, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        "messages[0].content[0]",
    ),
    (
        {**HELLO_BODY, "messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
        "messages[0].content[0].tool_use_id",
    ),
    (
        {**HELLO_BODY, "messages": [{"role": "user", "content": [{"type": "text", "text": 3}]}]},
        "messages[0].content[0].text",
    ),
    ({**HELLO_BODY, "messages": [{"role": "user", "content": ["Hi"]}]}, "messages[0].content[0]"),
]


@pytest.mark.parametrize(("body", "field"), BAD_REQUESTS)
def test_a_bad_field_is_a_400_in_anthropics_shape_naming_it(start_server, scripted, body, field) -> None:
    server = start_server(scripted)
    response = server.http.post(f"{server.url}/v1/messages", json=body)
    assert response.status_code == 400, response.text
    error = response.json()
    assert (error["type"], set(error["error"]), error["error"]["type"]) == (
        "error",
        {"type", "message"},
        "invalid_request_error",
    )
    assert field in error["error"]["message"] and "\n" not in error["error"]["message"]


def test_anthropics_client_raises_what_the_status_says(start_server, scripted) -> None:
    server = start_server(scripted, limits=Limits(body_bytes=3000, messages=3, message_chars=100))
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        server.anthropic.messages.create(model="tiny", messages=HELLO, max_tokens=None)  # sent as null
    with pytest.raises(anthropic.BadRequestError, match="longer than 100"):
        server.anthropic.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "x" * 101}])
    with pytest.raises(anthropic.BadRequestError, match="at most 3 messages"):
        server.anthropic.messages.create(
            model="tiny", max_tokens=4, messages=[*HELLO, {"role": "assistant", "content": "a"}] * 2
        )
    huge = server.http.post(f"{server.url}/v1/messages", json={**HELLO_BODY, "system": "x" * 4000})
    assert (huge.status_code, huge.json()["error"]["type"]) == (413, "request_too_large")
    bad_json = server.http.post(f"{server.url}/v1/messages", content=b"{not json")
    assert (bad_json.status_code, bad_json.json()["error"]["type"]) == (400, "invalid_request_error")
    with pytest.raises(anthropic.NotFoundError) as gone:
        server.anthropic.messages.create(
            model="tiny", max_tokens=4, messages=HELLO, extra_headers={"X-Streamchat-Conversation": "x"}
        )
    assert gone.value.body["error"]["type"] == "not_found_error"


def test_the_api_key_may_come_as_x_api_key(start_server, scripted) -> None:
    server = start_server(scripted, api_key="s3cret")
    assert server.anthropic.messages.create(**HELLO_BODY).content[0].text == REPLY  # it sends x-api-key
    for headers in ({}, {"x-api-key": "nope"}, {"Authorization": "Bearer nope"}):
        refused = server.http.post(f"{server.url}/v1/messages", json=HELLO_BODY, headers=headers)
        assert (refused.status_code, refused.json()["error"]["type"]) == (401, "authentication_error")
    as_bearer = server.http.post(
        f"{server.url}/v1/messages", json=HELLO_BODY, headers={"Authorization": "Bearer s3cret"}
    )
    assert as_bearer.status_code == 200
    # And on the other endpoints too.
    models = server.http.get(f"{server.url}/v1/models", headers={"x-api-key": "s3cret"})
    assert models.status_code == 200


def test_a_full_line_is_a_429_an_overloaded_one_a_rate_limit_error(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1, max_waiting=0)
    body = {**HELLO_BODY, "max_tokens": 5000, "stream": True}
    with server.http.stream("POST", f"{server.url}/v1/messages", json=body) as response:
        lines = response.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        full = server.http.post(f"{server.url}/v1/messages", json=HELLO_BODY)
        assert (full.status_code, full.headers["retry-after"], full.json()["error"]["type"]) == (
            429,
            "1",
            "rate_limit_error",
        )
        with pytest.raises(anthropic.RateLimitError):
            server.anthropic.messages.create(**HELLO_BODY)
    wait_idle(server)


def test_a_client_that_leaves_stops_its_reply_streamed_or_not(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1)
    body = {**HELLO_BODY, "max_tokens": 10**6, "stream": True}
    with server.http.stream("POST", f"{server.url}/v1/messages", json=body) as response:
        conversation = response.headers["x-streamchat-conversation"]
        lines = response.iter_lines()
        next(line for line in lines if "content_block_delta" in line)
    wait_idle(server)  # a million tokens: only a stop ends it
    last = json.loads((server.sessions / f"{conversation}.jsonl").read_text().splitlines()[-1])
    assert (last["type"], last["stop_reason"]) == ("reply", "interrupted")
    whole = json.dumps({**HELLO_BODY, "max_tokens": 10**6, "messages": [{"role": "user", "content": "Gone."}]})
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(raw_request(whole.encode()).replace(b"/v1/chat/completions", b"/v1/messages"))
        wait_until(lambda: any(held.busy for held in list(server.pool.conversations.values())), "the reply to begin")
    wait_idle(server)
    (journal,) = [path for path in server.sessions.glob("*.jsonl") if "Gone." in path.read_text()]
    last = json.loads(journal.read_text().splitlines()[-1])
    assert (last["type"], last["stop_reason"]) == ("reply", "interrupted")


def test_a_max_tokens_past_the_server_limit_is_clamped_and_said(start_server, endless) -> None:
    server = start_server(endless, reply_tokens_limit=5)
    raw = server.anthropic.messages.with_raw_response.create(model="tiny", max_tokens=10**9, messages=HELLO)
    assert (raw.parse().stop_reason, raw.parse().usage.output_tokens) == ("max_tokens", 5)
    assert raw.headers["x-streamchat-warning"] == "max_tokens 1,000,000,000 is past the server's limit: clamped to 5"
