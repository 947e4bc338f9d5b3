"""Connections that send a request slowly, or half of one, are closed; the server goes on answering."""

from __future__ import annotations

import logging
import socket

from streamchat.serve.connections import HeaderDeadlineProtocol
from tests.serve.conftest import HELLO_BODY, raw_exchange, raw_request


def test_a_connection_that_sends_half_its_headers_is_closed(start_server, scripted, monkeypatch) -> None:
    monkeypatch.setattr(HeaderDeadlineProtocol, "header_seconds", 0.2)
    server = start_server(scripted)
    # raw_exchange returns when the server closes the connection: it never answers half a header.
    assert raw_exchange(server, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ") == b""
    assert raw_exchange(server, b"") == b""  # a connection that sends nothing is closed too
    assert server.post(HELLO_BODY).status_code == 200


def test_a_body_not_sent_in_time_is_a_408(start_server, scripted) -> None:
    server = start_server(scripted, body_seconds=0.2)
    answer = raw_exchange(server, raw_request(b'{"messages": [', "Content-Length: 500"))
    assert answer.startswith(b"HTTP/1.1 408 ")
    assert b'"code":"request_timeout"' in answer
    assert server.post(HELLO_BODY).status_code == 200


def test_a_body_framed_twice_is_a_400(start_server, scripted) -> None:
    server = start_server(scripted)
    both = raw_request(b"2\r\n{}\r\n0\r\n\r\n", "Content-Length: 2", "Transfer-Encoding: chunked")
    answer = raw_exchange(server, both)
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert b"both Content-Length and Transfer-Encoding" in answer


def test_a_broken_chunked_body_is_a_400_and_no_traceback(start_server, scripted, caplog, capfd) -> None:
    server = start_server(scripted)
    with caplog.at_level(logging.WARNING):
        answer = raw_exchange(server, raw_request(b"5\r\n{}\r\n0\r\n\r\n", "Transfer-Encoding: chunked"))
        assert server.post(HELLO_BODY).status_code == 200
    assert answer.startswith(b"HTTP/1.1 400 ")
    assert all(record.exc_info is None for record in caplog.records)
    assert "Traceback" not in capfd.readouterr().err  # uvicorn's own log, which caplog does not see


def test_an_upload_cut_short_is_one_line_in_the_log(start_server, scripted, caplog) -> None:
    server = start_server(scripted)
    with caplog.at_level(logging.WARNING):
        raw_exchange_closed_early(server, raw_request(b'{"messages": [', "Content-Length: 500"))
        assert server.post(HELLO_BODY).status_code == 200  # the cut upload was handled before this answer
    assert [record.getMessage() for record in caplog.records] == [
        "a request's body was cut short: its client went away, or broke its framing"
    ]
    assert all(record.exc_info is None for record in caplog.records)


def raw_exchange_closed_early(server, data: bytes) -> None:
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1]))) as sock:
        sock.sendall(data)
