"""`streamchat serve` as a process: it loads, says where it listens, answers, and on SIGTERM or Ctrl-C
stops the replies in flight (kept, the streams ended whole), saves every conversation and exits
143 or 0 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import pytest

from streamchat.measure.server_process import free_port
from streamchat.storage.session_file import read_session
from tests.support.model_dirs import save_tiny_chat_model
from tests.support.processes import in_foreground
from tests.support.waiting import HANG_GUARD_SECONDS, wait_until

HELLO = [{"role": "user", "content": "Hello!"}]


@contextmanager
def serving(model: Path, data: Path) -> Iterator[tuple[subprocess.Popen, str, httpx.Client]]:
    """`streamchat serve` over `model` with its sessions in `data`, answering on a free 127.0.0.1 port;
    killed at the end if it is still running."""
    port = free_port()
    command = [sys.executable, "-m", "streamchat", "serve", "--model", str(model), "--port", str(port)]
    env = {**os.environ, "STREAMCHAT_DATA_DIR": str(data), "PYTHONPATH": str(Path.cwd())}
    # A reply runs until the test stops it: the default limit on a reply's length is the window, 64 tokens,
    # which a reply could reach before a kill meant to land mid-reply.
    command += ["--window", "64", "--max-tokens-limit", "1000000"]
    process = subprocess.Popen(in_foreground(command), env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(trust_env=False, timeout=HANG_GUARD_SECONDS) as client:

            def answers() -> bool:
                try:
                    client.get(f"{url}/health")
                    return True
                except httpx.TransportError:
                    return False

            wait_until(answers, f"{url}/health to answer", process)  # a server that exits fails at once
            yield process, url, client
    finally:
        process.kill()


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 0)])
def test_a_signal_stops_the_replies_saves_every_conversation_and_exits_cleanly(
    tmp_path: Path, signum: int, exit_code: int
) -> None:
    model = save_tiny_chat_model(tmp_path / "model")  # its replies never end by themselves
    data = tmp_path / "data"
    with serving(model, data) as (process, url, client):
        done = client.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4})
        body = {"messages": [{"role": "user", "content": "On and on."}], "stream": True, "max_tokens": 100_000}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            in_flight = response.headers["x-streamchat-conversation"]
            process.send_signal(signum)  # mid-reply: it stops within a step, and the stream ends whole
            lines = [line for line in response.iter_lines() if line]
        _, errors = process.communicate(timeout=HANG_GUARD_SECONDS)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "interrupted"
    assert process.returncode == exit_code
    assert "Traceback" not in errors
    assert f"serving {model} at {url}/v1 (Ctrl-C stops)" in errors.splitlines()[1]
    sessions = data / "sessions"
    for conversation in (done.headers["x-streamchat-conversation"], in_flight):
        assert (sessions / f"{conversation}.cache.safetensors").is_file()
    last = json.loads((sessions / f"{in_flight}.jsonl").read_text(encoding="utf-8").splitlines()[-1])
    assert (last["type"], last["stop_reason"]) == ("reply", "interrupted")


def test_after_a_kill_mid_reply_every_conversation_goes_on_from_its_journal(tmp_path: Path) -> None:
    model = save_tiny_chat_model(tmp_path / "model")
    data = tmp_path / "data"
    with serving(model, data) as (process, url, client):
        answered = client.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4})
        reply = answered.json()["choices"][0]["message"]["content"]
        body = {"messages": [{"role": "user", "content": "On and on."}], "stream": True, "max_tokens": 100_000}
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            in_flight = response.headers["x-streamchat-conversation"]
            lines = response.iter_lines()  # kept: a dropped line iterator closes the response, and the client leaves
            next(line for line in lines if '"content"' in line)  # the reply is under way
            process.kill()  # kill -9: no state written, the reply in flight lost
        process.wait(timeout=HANG_GUARD_SECONDS)
    first = answered.headers["x-streamchat-conversation"]
    with serving(model, data) as (_, url, client):
        # The first conversation, resent whole as a client does, is found again from its journal.
        history = [*HELLO, {"role": "assistant", "content": reply}, {"role": "user", "content": "Again?"}]
        again = client.post(f"{url}/v1/chat/completions", json={"messages": history, "max_tokens": 4})
        # The one killed mid-reply, its message sent again, goes on in the same journal: no fork.
        resent = client.post(f"{url}/v1/chat/completions", json={"messages": body["messages"], "max_tokens": 4})
        # And by its id: its message without a reply was left out.
        named = {"x-streamchat-conversation": in_flight}
        after = client.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4}, headers=named)
    assert (again.status_code, again.headers["x-streamchat-conversation"]) == (200, first)
    assert (resent.status_code, resent.headers["x-streamchat-conversation"]) == (200, in_flight)
    assert (after.status_code, after.headers["x-streamchat-conversation"]) == (200, in_flight)
    assert len(list((data / "sessions").glob("*.jsonl"))) == 2
    sessions = data / "sessions"
    assert [m["content"] for m in read_session(sessions / f"{first}.jsonl").messages][:3] == [
        "Hello!",
        reply,
        "Again?",
    ]
    killed = [m["content"] for m in read_session(sessions / f"{in_flight}.jsonl").messages]
    assert killed[::2] == ["On and on.", "Hello!"]
