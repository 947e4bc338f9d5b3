"""scripts/serve_hostile_check.py's pure parts: a response read from raw bytes as they come, the log's tracebacks.

The script itself needs the default model and minutes; it is run by hand, never here.
"""

from __future__ import annotations

import socket
import threading

from tests.support.scripts import load_script

check = load_script("serve_hostile_check")


def served_once(pieces: list[bytes]) -> tuple[int, list[bytes]]:
    """A loopback port that answers one connection with `pieces`, each sent alone, then closes; and the request
    bytes it received (filled in once the request's head and body are in)."""
    listener = socket.create_server(("127.0.0.1", 0))
    received: list[bytes] = []

    def answer() -> None:
        connection, _ = listener.accept()
        with connection, listener:
            connection.settimeout(10)
            data = b""
            while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
                data.partition(b"Content-Length: ")[2].split(b"\r\n")[0]
            ):
                data += connection.recv(65536)
            received.append(data)
            for piece in pieces:
                connection.sendall(piece)
                threading.Event().wait(0.01)  # each piece its own recv

    threading.Thread(target=answer, daemon=True).start()
    return listener.getsockname()[1], received


def chunked(body: bytes, cuts: int) -> list[bytes]:
    """`body` in chunked framing, then cut into `cuts` pieces at places that split lines and events."""
    events = [event + b"\n\n" for event in body.split(b"\n\n") if event]  # a chunk for each, as uvicorn sends
    framed = b"".join(b"%x\r\n%s\r\n" % (len(event), event) for event in events) + b"0\r\n\r\n"
    step = max(1, len(framed) // cuts)
    return [framed[start : start + step] for start in range(0, len(framed), step)]


def test_a_chunked_event_stream_read_in_pieces() -> None:
    events = [
        b'data: {"choices": [{"delta": {"role": "assistant", "content": ""}, "finish_reason": null}]}',
        b'data: {"choices": [{"delta": {"content": "Hel"}, "finish_reason": null}]}',
        b'data: {"choices": [{"delta": {"content": "lo \xc3\xa9"}, "finish_reason": null}]}',
        b'data: {"choices": [{"delta": {}, "finish_reason": "interrupted"}]}',
        b"data: [DONE]",
    ]
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Streamchat-Conversation: 20250101-120000-3fa2c1\r\n\r\n"
    body = b"".join(event + b"\n\n" for event in events)
    port, received = served_once([head, *chunked(body, 7)])
    exchange = check.Exchange(port, check.request_bytes(b'{"messages": []}', {"X-Name": "é".encode()}))
    assert exchange.read(check.has_content(1), seconds=10)
    assert exchange.text() == "Hel" and exchange.finish_reason() is None
    assert exchange.read(seconds=10)
    exchange.close()
    assert received == [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b'Content-Length: 16\r\nX-Name: \xc3\xa9\r\n\r\n{"messages": []}'
    ]
    assert (exchange.status, exchange.complete, exchange.conversation()) == (200, True, "20250101-120000-3fa2c1")
    assert exchange.text() == "Hello é"
    assert exchange.finish_reason() == "interrupted"
    assert exchange.events()[-1] == "[DONE]"
    assert check.outcome(exchange) == "200"


def test_an_error_with_content_length_and_a_429_without_retry_after() -> None:
    body = b'{"error": {"message": "too many requests are waiting", "param": null}}'
    head = b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: %d\r\n\r\n" % len(body)
    port, _ = served_once([head, body[:10], body[10:]])
    exchange = check.whole(port, check.request_bytes(b"{}"), seconds=10)
    assert exchange.complete and not exchange.closed
    assert exchange.said() == "429 'too many requests are waiting'"
    assert check.outcome(exchange) == "429 without Retry-After"


def test_a_stream_that_ends_without_content_or_done_is_empty() -> None:
    head = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    port, _ = served_once([head, *chunked(b'data: {"choices": [{"delta": {"content": ""}}]}\n\n', 2)])
    exchange = check.whole(port, check.request_bytes(b"{}"), seconds=10)
    assert check.outcome(exchange) == "200 empty"


def test_the_exception_each_traceback_ends_with() -> None:
    log = [
        "serving smollm2-135m at http://127.0.0.1:8000/v1 (Ctrl-C stops)",
        "ERROR:    Exception in ASGI application",
        "Traceback (most recent call last):",
        '  File "streamchat/serve/openai_api.py", line 238, in _settings',
        "    rule = SAMPLING_RULES[name]",
        "",
        "KeyError: 'frequency_penalty'",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: no",
    ]
    assert check.raised(log) == ["KeyError: 'frequency_penalty'", "ValueError: no"]
    assert check.raised(log[:2]) == []
