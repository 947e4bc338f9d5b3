"""The resending chat client: server-sent events read back, usage, errors and empty replies, histories resent."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from streamchat.measure.chat_client import (
    Endpoint,
    ListedModel,
    Workload,
    questions,
    run_conversations,
    served_model,
    stream_chat,
    user_turn,
)
from tests.support.waiting import HANG_GUARD_SECONDS

Answer = Callable[[dict], tuple[int, list[str]]]


def _events(*payloads: dict) -> list[str]:
    return [f"data: {json.dumps(payload)}\n\n" for payload in payloads] + ["data: [DONE]\n\n"]


def _delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


@pytest.fixture
def fake_server() -> Iterator[Callable[[Answer], tuple[Endpoint, list[dict]]]]:
    """A loopback server that answers each chat request as `answer` says, and keeps every request's body."""
    servers: list[ThreadingHTTPServer] = []

    def start(answer: Answer) -> tuple[Endpoint, list[dict]]:
        received: list[dict] = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                listed = {"id": "fake-model", "object": "model", "meta": {"kv_cache": "int8"}}
                body = json.dumps({"object": "list", "data": [listed]}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                received.append(request)
                status, pieces = answer(request)
                self.send_response(status)
                self.send_header("Content-Type", "text/event-stream" if status == 200 else "application/json")
                self.send_header("X-Streamchat-Cache", f"{len(received)}/10, evicted 0")
                self.end_headers()
                for piece in pieces:
                    self.wfile.write(piece.encode())
                    self.wfile.flush()

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        servers.append(server)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return Endpoint("127.0.0.1", server.server_address[1]), received

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def test_a_streamed_reply_with_usage(fake_server) -> None:
    usage = {"prompt_tokens": 120, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 100}}
    endpoint, _ = fake_server(
        lambda request: (200, _events(_delta(""), _delta("Hel"), _delta("lo!"), {"choices": [], "usage": usage}))
    )
    reply = stream_chat(endpoint, {"messages": []}, timeout=HANG_GUARD_SECONDS)
    assert (reply.text, reply.tokens, reply.prompt_tokens, reply.cached_tokens) == ("Hello!", 3, 120, 100)
    assert reply.read_tokens == 20 and reply.error is None and not reply.empty
    assert reply.cache == "1/10, evicted 0"
    assert 0 < reply.ttft <= reply.seconds


def test_without_usage_tokens_are_the_chunks_with_text_and_nothing_is_read(fake_server) -> None:
    # llama-cpp-python's server: no usage in its streams.
    endpoint, _ = fake_server(lambda request: (200, _events(_delta("a"), _delta("b"), _delta(""))))
    reply = stream_chat(endpoint, {"messages": []}, timeout=HANG_GUARD_SECONDS)
    assert (reply.text, reply.tokens, reply.prompt_tokens, reply.read_tokens) == ("ab", 2, None, None)


def test_an_empty_reply_is_empty_not_an_error(fake_server) -> None:
    endpoint, _ = fake_server(lambda request: (200, _events({"choices": [{"delta": {}, "finish_reason": "length"}]})))
    reply = stream_chat(endpoint, {"messages": []}, timeout=HANG_GUARD_SECONDS)
    assert reply.empty and reply.error is None and reply.ttft is None and reply.tokens == 0


def test_an_error_status_is_its_message_on_one_line(fake_server) -> None:
    message = "request (2107 tokens) exceeds\nthe available context size (2048 tokens)"
    endpoint, _ = fake_server(lambda request: (400, [json.dumps({"error": {"message": message, "code": 400}})]))
    reply = stream_chat(endpoint, {"messages": []}, timeout=HANG_GUARD_SECONDS)
    assert reply.error == "HTTP 400: request (2107 tokens) exceeds the available context size (2048 tokens)"
    assert not reply.empty


def test_an_error_event_mid_stream_is_an_error(fake_server) -> None:
    endpoint, _ = fake_server(lambda request: (200, _events(_delta("a"), {"error": {"message": "stopped"}})))
    assert stream_chat(endpoint, {"messages": []}, timeout=HANG_GUARD_SECONDS).error == "stopped"


def test_a_server_that_is_gone_is_an_error_not_an_exception(fake_server) -> None:
    endpoint, _ = fake_server(lambda request: (200, []))
    reply = stream_chat(Endpoint("127.0.0.1", 1), {"messages": []}, timeout=HANG_GUARD_SECONDS)
    assert reply.error is not None and reply.error.startswith("ConnectionRefusedError")
    assert served_model(Endpoint("127.0.0.1", 1), timeout=HANG_GUARD_SECONDS) == ListedModel("default", {})
    assert served_model(endpoint, timeout=HANG_GUARD_SECONDS) == ListedModel("fake-model", {"kv_cache": "int8"})


def test_every_turn_resends_the_history_and_a_failed_turn_is_dropped_from_it(fake_server) -> None:
    def answer(request: dict) -> tuple[int, list[str]]:
        if request["messages"][-1]["content"] == questions()[1]:  # conversation 1's second turn fails
            return 400, [json.dumps({"error": {"message": "too long"}})]
        return 200, _events(_delta(f"reply {len(request['messages'])}"))

    endpoint, received = fake_server(answer)
    workload = Workload(
        conversations=1,
        turns=3,
        max_tokens=5,
        request_timeout=HANG_GUARD_SECONDS,
        time_limit=HANG_GUARD_SECONDS,
        system_prompt="Sys",
    )
    records, seconds = run_conversations(endpoint, "fake-model", workload, threading.Event())
    assert [(record.turn, record.reply.error) for record in records] == [
        (1, None),
        (2, "HTTP 400: too long"),
        (3, None),
    ]
    assert seconds > 0
    pool = questions()
    assert received[2]["messages"] == [
        {"role": "system", "content": "Sys"},
        {"role": "user", "content": f"Hello, I am user 1. {pool[0]}"},
        {"role": "assistant", "content": "reply 2"},
        {"role": "user", "content": pool[2]},
    ]
    assert {key: received[0][key] for key in ("model", "max_tokens", "temperature", "stream", "stream_options")} == {
        "model": "fake-model",
        "max_tokens": 5,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_a_stopped_run_sends_nothing_more() -> None:
    stop = threading.Event()
    stop.set()
    workload = Workload(
        conversations=2, turns=2, max_tokens=5, request_timeout=HANG_GUARD_SECONDS, time_limit=HANG_GUARD_SECONDS
    )
    records, _ = run_conversations(Endpoint("127.0.0.1", 1), "m", workload, stop)
    assert [(record.conversation, record.turn) for record in records] == [(1, 1), (1, 2), (2, 1), (2, 2)]
    assert all(record.reply.error.startswith("not sent") for record in records)


def test_the_questions_cycle_and_no_two_conversations_say_the_same() -> None:
    pool = questions()
    assert len(pool) == 40 and len(set(pool)) == 40
    assert user_turn(pool, 1, 41) == pool[0]
    assert user_turn(pool, 2, 2) == pool[8]
    firsts = {user_turn(pool, conversation, 1) for conversation in range(1, 100)}
    assert len(firsts) == 99
