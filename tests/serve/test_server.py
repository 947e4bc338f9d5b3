"""`streamchat serve` as a process: it loads, says where it listens, answers, and on SIGTERM or Ctrl-C
stops the replies in flight (kept, the streams ended whole), saves every conversation and exits
143 or 0 without a traceback."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx
import pytest

from tests.support.model_dirs import save_tiny_chat_model
from tests.support.processes import in_foreground

HELLO = [{"role": "user", "content": "Hello!"}]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 0)])
def test_a_signal_stops_the_replies_saves_every_conversation_and_exits_cleanly(
    tmp_path: Path, signum: int, exit_code: int
) -> None:
    model = save_tiny_chat_model(tmp_path / "model")  # its replies never end by themselves
    data = tmp_path / "data"
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "streamchat",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--window",
        "64",
    ]
    env = {**os.environ, "STREAMCHAT_DATA_DIR": str(data), "PYTHONPATH": str(Path.cwd())}
    process = subprocess.Popen(in_foreground(command), env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(trust_env=False, timeout=30) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get(f"{url}/health")
                    break
                except httpx.TransportError:
                    assert process.poll() is None and time.monotonic() < deadline
                    time.sleep(0.1)
            done = client.post(f"{url}/v1/chat/completions", json={"messages": HELLO, "max_tokens": 4})
            body = {"messages": [{"role": "user", "content": "On and on."}], "stream": True, "max_tokens": 100_000}
            with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                in_flight = response.headers["x-streamchat-conversation"]
                process.send_signal(signum)  # mid-reply: it stops within a step, and the stream ends whole
                lines = [line for line in response.iter_lines() if line]
        _, errors = process.communicate(timeout=30)
    finally:
        process.kill()
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "stop"
    assert process.returncode == exit_code
    assert "Traceback" not in errors
    assert f"serving {model} at {url}/v1 (Ctrl-C stops)" in errors.splitlines()[1]
    sessions = data / "sessions"
    for conversation in (done.headers["x-streamchat-conversation"], in_flight):
        assert (sessions / f"{conversation}.cache.safetensors").is_file()
    last = json.loads((sessions / f"{in_flight}.jsonl").read_text(encoding="utf-8").splitlines()[-1])
    assert (last["type"], last["stop_reason"]) == ("reply", "interrupted")
