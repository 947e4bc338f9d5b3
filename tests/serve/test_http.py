"""The HTTP face through the official openai client and raw HTTP: shapes, headers, errors."""

from __future__ import annotations

import json
import math
import socket

import jsonschema
import openai
import pytest

from streamchat.conversation.state import RecalledNote
from streamchat.serve.apis.request import Limits
from streamchat.storage.session_file import read_session
from tests.serve.conftest import HELLO_BODY, REPLY, raw_request, wait_idle, wait_until
from tests.support.model_dirs import HOSTILE_REPLY_PIECES, scripted_model_and_tokenizer

HELLO = [{"role": "user", "content": "Hello!"}]


def test_a_whole_reply_in_openai_shape(start_server, scripted) -> None:
    server = start_server(scripted)
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, temperature=0)
    reply = raw.parse()
    conversation = raw.headers["x-streamchat-conversation"]
    assert reply.object == "chat.completion" and reply.model == "tiny" and reply.id.startswith("chatcmpl-")
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in reply.choices] == [
        (0, "assistant", REPLY, "stop")
    ]
    usage = reply.usage
    assert usage.completion_tokens == len(("Sure", ":", " the", " answer", " is", " 42", "."))
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens == 0
    _, capacity = raw.headers["x-streamchat-cache"].split(", ")[0].split("/")
    assert (int(capacity), raw.headers["x-streamchat-cache"].endswith("evicted 0")) == (4 + 64, True)
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    assert saved.messages == [*HELLO, {"role": "assistant", "content": REPLY}]


def test_a_streamed_reply_is_chunks_then_usage_then_done(start_server, scripted) -> None:
    server = start_server(scripted)
    body = {"messages": HELLO, "stream": True, "stream_options": {"include_usage": True}}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert {chunk["object"] for chunk in chunks} == {"chat.completion.chunk"}
    assert len({chunk["id"] for chunk in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(chunk["choices"][0]["delta"].get("content", "") for chunk in chunks[:-1])
    assert text == REPLY
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks[:-1]] == [None] * (len(chunks) - 2) + ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 7
    # The openai client reads the same stream.
    stream = server.client.chat.completions.create(model="tiny", messages=HELLO, stream=True, max_tokens=40)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == REPLY


def test_models_health_and_conversations(start_server, scripted) -> None:
    server = start_server(scripted)
    assert [model.id for model in server.client.models.list()] == ["tiny"]
    assert server.http.get(f"{server.url}/health").json()["status"] == "ok"
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO)
    listed = server.http.get(f"{server.url}/v1/conversations").json()["data"]
    assert listed == [
        {"id": raw.headers["x-streamchat-conversation"], "object": "conversation", "state": "live"},
    ]


BAD_REQUESTS = [
    ({"messages": HELLO, "n": 2}, "n"),
    ({"messages": HELLO, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"messages": HELLO, "logit_bias": {"1": 5}}, "logit_bias"),
    ({"messages": HELLO, "logprobs": 0}, "logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": HELLO, "logprobs": True, "top_logprobs": 2.5}, "top_logprobs"),
    ({"messages": HELLO, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": HELLO, "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": HELLO, "response_format": {"type": "json_schema"}}, "response_format"),
    ({"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": []}}, "response_format.json_schema"),
    (
        {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
        "response_format.json_schema.name",
    ),
    (
        {"messages": HELLO, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
        "response_format.json_schema.schema",
    ),
    (
        {
            "messages": HELLO,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        },
        "response_format.json_schema.schema",
    ),
    ({"messages": HELLO, "temperature": -1}, "temperature"),
    ({"messages": HELLO, "top_p": 0}, "top_p"),
    ({"messages": HELLO, "max_tokens": 0}, "max_tokens"),
    ({"messages": HELLO, "seed": "x"}, "seed"),
    ({"messages": HELLO, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": HELLO, "stream": "yes"}, "stream"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [*HELLO, {"role": "assistant", "content": "x"}]}, "messages"),
]


@pytest.mark.parametrize(("body", "param"), BAD_REQUESTS)
def test_a_bad_field_is_a_400_naming_it(start_server, scripted, body, param) -> None:
    server = start_server(scripted)
    response = server.post(body)
    error = response.json()["error"]
    assert (response.status_code, error["param"], error["type"]) == (400, param, "invalid_request_error")
    assert set(error) == {"message", "type", "param", "code"}


def test_a_bad_temperature_is_refused_in_openai_words(start_server, scripted) -> None:
    server = start_server(scripted)
    response = server.post({"messages": HELLO, "temperature": -1})
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": "'temperature' must be a number >= 0",
            "type": "invalid_request_error",
            "param": "temperature",
            "code": None,
        }
    }


def test_malformed_json_too_many_messages_and_too_large_bodies(start_server, scripted) -> None:
    server = start_server(scripted, limits=Limits(body_bytes=2000, messages=3, message_chars=100))
    bad_json = server.http.post(f"{server.url}/v1/chat/completions", content=b"{not json")
    assert bad_json.status_code == 400 and "not valid JSON" in bad_json.json()["error"]["message"]
    many = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}] * 2 + HELLO
    assert server.post({"messages": many}).json()["error"]["param"] == "messages"
    long = server.post({"messages": [{"role": "user", "content": "x" * 101}]})
    assert (long.status_code, long.json()["error"]["param"]) == (400, "messages[0].content")
    huge = server.post({"messages": [{"role": "user", "content": "x" * 3000}]})
    assert huge.status_code == 413
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model="tiny", messages=HELLO, n=2)


def test_an_api_key_guards_every_endpoint_but_health(start_server, scripted) -> None:
    server = start_server(scripted, api_key="s3cret")
    assert server.http.get(f"{server.url}/health").status_code == 200
    for path in ("/v1/models", "/v1/conversations"):
        assert server.http.get(f"{server.url}{path}").status_code == 401
        wrong = server.http.get(f"{server.url}{path}", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
    assert server.post({"messages": HELLO}).status_code == 401
    assert server.client.chat.completions.create(model="tiny", messages=HELLO).choices[0].message.content == REPLY
    bad_client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0, http_client=server.http)
    with pytest.raises(openai.AuthenticationError):
        bad_client.models.list()


def test_an_unknown_conversation_is_a_404(start_server, scripted) -> None:
    server = start_server(scripted)
    for name in ("20250101-120000-3fa2c1", "../../etc/passwd", "x"):
        response = server.post({"messages": HELLO}, headers={"X-Streamchat-Conversation": name})
        assert (response.status_code, response.json()["error"]["code"]) == (404, "not_found")


def test_a_second_request_for_a_busy_conversation_is_a_409(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1, max_waiting=1)
    body = {"messages": HELLO, "stream": True, "max_tokens": 5000}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        conversation = response.headers["x-streamchat-conversation"]
        lines = response.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        busy = server.post({"messages": HELLO}, headers={"X-Streamchat-Conversation": conversation})
        assert (busy.status_code, busy.json()["error"]["code"]) == (409, "conversation_busy")
    wait_idle(server)


def test_past_the_waiting_requests_a_429_says_when_to_retry(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1, max_waiting=0)
    body = {"messages": HELLO, "stream": True, "max_tokens": 5000}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        full = server.post({"messages": [{"role": "user", "content": "another"}]})
        assert (full.status_code, full.headers["retry-after"]) == (429, "1")
        with pytest.raises(openai.RateLimitError):
            server.client.chat.completions.create(model="tiny", messages=HELLO)
    wait_idle(server)


def test_a_request_that_waits_in_line_past_its_limit_gets_a_429(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1, max_waiting=4, max_wait_seconds=0.05)
    body = {"messages": HELLO, "stream": True, "max_tokens": 10**9}  # holds the only conversation for ever
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()  # kept: a dropped line iterator closes the response
        next(lines)
        waited = server.post({"messages": [{"role": "user", "content": "another"}]})
        error = waited.json()["error"]
        assert (waited.status_code, waited.headers["retry-after"], error["code"]) == (429, "1", "busy")
        assert "--max-wait-seconds" in error["message"]
    wait_idle(server)


def test_a_client_that_leaves_while_in_line_leaves_nothing_behind(start_server, endless) -> None:
    server = start_server(endless, max_conversations=1, max_waiting=4)
    body = {"messages": HELLO, "stream": True, "max_tokens": 10**9}
    with server.http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        next(lines)
        gone = json.dumps({"messages": [{"role": "user", "content": "I will not wait."}]}).encode()
        with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
            sock.sendall(raw_request(gone))
            wait_until(lambda: server.worker.admitted == 2, "the second request to be in line")
        wait_until(lambda: server.worker.admitted == 1, "the request in line to leave with its client")
    wait_idle(server)
    assert not any("I will not wait." in path.read_text() for path in server.sessions.glob("*.jsonl"))


def test_json_carries_the_model_text_exactly(start_server) -> None:
    """The terminal's escaping is for terminals: a reply full of escape sequences arrives byte for byte."""
    server = start_server(scripted_model_and_tokenizer(HOSTILE_REPLY_PIECES))
    whole = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=40)
    assert whole.choices[0].message.content == "".join(HOSTILE_REPLY_PIECES)
    stream = server.client.chat.completions.create(model="tiny", messages=HELLO, stream=True, max_tokens=40)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == "".join(
        HOSTILE_REPLY_PIECES
    )


def test_cors_is_off_unless_an_origin_is_given(start_server, scripted) -> None:
    preflight = {
        "Origin": "https://chat.example.org",
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    closed = start_server(scripted)
    assert (
        "access-control-allow-origin"
        not in closed.http.options(f"{closed.url}/v1/chat/completions", headers=preflight).headers
    )
    opened = start_server(scripted, cors=("https://chat.example.org",))
    allowed = opened.http.options(f"{opened.url}/v1/chat/completions", headers=preflight)
    assert (allowed.status_code, allowed.headers["access-control-allow-origin"]) == (200, "https://chat.example.org")
    reply = opened.post({"messages": HELLO}, headers={"Origin": "https://chat.example.org"})
    assert "x-streamchat-conversation" in reply.headers["access-control-expose-headers"].lower()
    other = {**preflight, "Origin": "https://elsewhere.example"}
    assert opened.http.options(f"{opened.url}/v1/chat/completions", headers=other).status_code == 400


def test_a_conversation_recalls_what_left_its_cache_and_journals_the_note(start_server, scripted) -> None:
    server = start_server(scripted, window=256)
    fact = "My sister's name is Ilse."
    filler = "Write a short poem about a lighthouse on a stormy night, with waves and gulls and a keeper."
    history = [{"role": "user", "content": fact}]
    conversation = None
    for _ in range(12):  # enough turns for the fact to leave a 256-token window
        response = server.post({"messages": history, "temperature": 0})
        assert response.status_code == 200, response.text
        conversation = response.headers["x-streamchat-conversation"]
        history += [response.json()["choices"][0]["message"], {"role": "user", "content": filler}]
    history[-1] = {"role": "user", "content": "What is my sister's name?"}
    response = server.post({"messages": history, "temperature": 0})
    assert response.status_code == 200 and response.headers["x-streamchat-conversation"] == conversation
    saved = read_session(server.sessions / f"{conversation}.jsonl")
    question = len(history) - 1
    assert saved.messages[question] == {"role": "user", "content": "What is my sister's name?"}
    assert saved.recalled == {
        question: RecalledNote(messages=(0,), text=f"Earlier in this conversation:\nI said: {fact}")
    }


def test_bodies_that_used_to_be_500s_are_400s_or_answered(start_server, scripted, capfd) -> None:
    server = start_server(scripted)
    nested = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep = server.http.post(f"{server.url}/v1/chat/completions", content=nested)
    assert (deep.status_code, deep.json()["error"]["message"]) == (400, "the request body is nested too deeply")
    digits = "9" * 5000
    for field in ("seed", "max_tokens"):
        body = f'{{"messages": [{{"role": "user", "content": "Hi"}}], "{field}": {digits}}}'.encode()
        huge = server.http.post(f"{server.url}/v1/chat/completions", content=body)
        assert (huge.status_code, huge.json()["error"]["param"]) == (400, field)
    nan = server.http.post(
        f"{server.url}/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "Hi"}], "top_p": NaN}'
    )
    assert nan.status_code == 400 and "NaN is not a JSON number" in nan.json()["error"]["message"]
    # A lone surrogate is a valid JSON escape but no character: it becomes U+FFFD, and the reply goes on.
    lone = b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}'
    answered = server.http.post(f"{server.url}/v1/chat/completions", content=lone)
    assert answered.status_code == 200
    saved = read_session(server.sessions / f"{answered.headers['x-streamchat-conversation']}.jsonl")
    assert saved.messages[0] == {"role": "user", "content": "a\ufffdb"}
    assert len(list(server.sessions.glob("*.jsonl"))) == 1  # no journal left without its messages
    assert "Traceback" not in capfd.readouterr().err


def test_the_fields_common_clients_send_at_neutral_values_are_accepted(start_server, scripted) -> None:
    server = start_server(scripted)
    neutral = {
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "logprobs": False,
        "top_logprobs": None,
        "response_format": {"type": "text"},
        "store": False,
        "metadata": {"app": "test"},
        "user": "ada",
        "tools": [],
        "tool_choice": "none",
        "logit_bias": {},
        "top_k": 40,
    }
    reply = server.post({**HELLO_BODY, **neutral})
    assert (reply.status_code, reply.json()["choices"][0]["message"]["content"]) == (200, REPLY)


def test_a_non_ascii_conversation_id_is_named_as_sent(start_server, scripted) -> None:
    server = start_server(scripted)
    name = "café-☕"
    response = server.post(HELLO_BODY, headers={"X-Streamchat-Conversation": name.encode()})
    assert (response.status_code, response.json()["error"]["message"]) == (404, f"no conversation {name!r}")


def test_a_max_tokens_past_the_server_limit_is_clamped_and_said(start_server, endless) -> None:
    server = start_server(endless, reply_tokens_limit=5)
    raw = server.client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO, max_tokens=10**9)
    reply = raw.parse()
    assert (reply.usage.completion_tokens, reply.choices[0].finish_reason) == (5, "length")
    assert raw.headers["x-streamchat-warning"] == "max_tokens 1,000,000,000 is past the server's limit: clamped to 5"
    unasked = server.client.chat.completions.with_raw_response.create(model="tiny", messages=HELLO)
    assert unasked.parse().usage.completion_tokens == 5  # the server's own default (8) is clamped too, silently
    assert "x-streamchat-warning" not in unasked.headers


def test_a_message_longer_than_the_cache_is_read_in_part_and_said(start_server, endless) -> None:
    server = start_server(endless, window=32)
    long = {"messages": [{"role": "user", "content": "word " * 200}], "max_tokens": 2}
    response = server.post(long)
    assert response.status_code == 200
    warning = response.headers["x-streamchat-warning"]
    assert warning.startswith("the message is ") and "more than the cache holds" in warning


def test_the_openai_client_with_penalties_gets_a_reply_that_they_change(start_server, endless) -> None:
    server = start_server(endless)
    asked = [{"role": "user", "content": "Say something."}]
    plain = server.client.chat.completions.create(model="tiny", messages=asked, max_tokens=24, temperature=0)
    penalized = server.client.chat.completions.create(
        model="tiny", messages=asked, max_tokens=24, temperature=0, frequency_penalty=0.5, presence_penalty=0.5
    )
    assert penalized.choices[0].finish_reason == "length"
    assert penalized.choices[0].message.content != plain.choices[0].message.content


def test_logprobs_come_with_each_token_whole_and_streamed_and_agree(start_server, scripted) -> None:
    server = start_server(scripted)
    asked = {"model": "tiny", "messages": HELLO, "logprobs": True, "top_logprobs": 3, "temperature": 0}
    whole = server.client.chat.completions.create(**asked)
    tokens = whole.choices[0].logprobs.content
    assert "".join(token.token for token in tokens) == whole.choices[0].message.content == REPLY
    assert len(tokens) == whole.usage.completion_tokens
    for token in tokens:
        best = [alternative.logprob for alternative in token.top_logprobs]
        assert len(best) == 3 and best == sorted(best, reverse=True) and best[0] <= 0
        assert sum(math.exp(value) for value in best) <= 1 + 1e-6
        # Greedy: the token drawn is the likeliest, its log-probability the best one's.
        assert (token.token, token.logprob) == (token.top_logprobs[0].token, best[0])
        assert token.bytes == list(token.token.encode())
    streamed = server.client.chat.completions.create(**asked, stream=True)
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    said = [token for chunk in chunks if chunk.logprobs for token in chunk.logprobs.content]
    assert [(t.token, t.logprob) for t in said] == [(t.token, t.logprob) for t in tokens]
    plain = server.client.chat.completions.create(model="tiny", messages=HELLO, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == REPLY


CHOICE = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "pick": {"enum": ["left", "right"]},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["ok", "pick"],
    "additionalProperties": False,
}


def test_a_schema_holds_the_reply_whole_and_streamed_and_only_that_request(start_server, endless) -> None:
    server = start_server(endless, reply_tokens_limit=None)
    schema = {"type": "json_schema", "json_schema": {"name": "choice", "schema": CHOICE, "strict": True}}
    asked = {"model": "tiny", "messages": HELLO, "response_format": schema, "max_tokens": 60}
    for seed in range(3):
        whole = server.client.chat.completions.create(**asked, seed=seed, temperature=1.0)
        jsonschema.validate(json.loads(whole.choices[0].message.content), CHOICE)
        assert whole.choices[0].finish_reason == "stop"
    streamed = server.client.chat.completions.create(**asked, temperature=0, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    jsonschema.validate(json.loads(text), CHOICE)
    any_object = server.client.chat.completions.create(
        model="tiny", messages=HELLO, response_format={"type": "json_object"}, max_tokens=60, temperature=0
    )
    assert any_object.choices[0].message.content.startswith("{")
    # The next request without one is free text again: this random model never stops by itself.
    free = server.client.chat.completions.create(model="tiny", messages=HELLO, max_tokens=8, temperature=0)
    assert free.choices[0].finish_reason == "length" and not free.choices[0].message.content.startswith("{")
