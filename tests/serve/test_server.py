"""`streamchat serve` as a process: it loads, says where it listens, answers, and on SIGTERM or Ctrl-C
saves every conversation and exits 143 or 0 without a traceback."""

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

from tests.support.model_dirs import save_scripted_chat_model
from tests.support.processes import in_foreground

SCRIPT = ("Sure", ":", " the", " answer", " is", " 42", ".")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize(("signum", "exit_code"), [(signal.SIGTERM, 143), (signal.SIGINT, 0)])
def test_a_signal_saves_every_conversation_and_exits_cleanly(tmp_path: Path, signum: int, exit_code: int) -> None:
    model = save_scripted_chat_model(tmp_path / "model", SCRIPT)
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
    try:
        with httpx.Client(trust_env=False, timeout=10) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    client.get(f"http://127.0.0.1:{port}/health")
                    break
                except httpx.TransportError:
                    assert process.poll() is None and time.monotonic() < deadline
                    time.sleep(0.1)
            body = {"messages": [{"role": "user", "content": "Hello!"}], "temperature": 0}
            reply = client.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body)
        assert reply.json()["choices"][0]["message"]["content"] == "Sure: the answer is 42."
        process.send_signal(signum)
        _, errors = process.communicate(timeout=30)
    finally:
        process.kill()
    conversation = reply.headers["x-streamchat-conversation"]
    assert process.returncode == exit_code
    assert "Traceback" not in errors
    assert f"serving {model} at http://127.0.0.1:{port}/v1 (Ctrl-C stops)" in errors.splitlines()[1]
    assert (data / "sessions" / f"{conversation}.cache.safetensors").is_file()
    records = (data / "sessions" / f"{conversation}.jsonl").read_text(encoding="utf-8").splitlines()
    assert json.loads(records[-1])["content"] == "Sure: the answer is 42."
