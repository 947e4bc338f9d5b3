"""A server started as a subprocess for a benchmark: on a free loopback port, ready, and always stopped.

`running(command)` starts it in a session of its own (Ctrl-C in the terminal reaches the
bench, which then stops the server in order), waits until its readiness path answers 200,
and when the block ends, however it ends, sends SIGTERM and, past STOP_SECONDS, SIGKILL.
Whatever the server writes goes to a log in a temporary directory, which also holds
streamchat's data directory for it, so a benchmark's conversations never join the user's
sessions; a server that exits or does not answer in time is a ConfigError quoting the
last line of its log.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.measure.chat_client import Endpoint

HOST = "127.0.0.1"
STOP_SECONDS = 20  # a server that has not exited this long after SIGTERM is killed
POLL_SECONDS = 0.1


@dataclass(frozen=True)
class ServerCommand:
    """How to start one server on a port: its command line, environment additions and readiness path."""

    name: str
    args: tuple[str, ...]  # "{port}" stands for the port
    health_path: str
    environment: tuple[tuple[str, str], ...] = ()

    def command_line(self, port: int) -> list[str]:
        return [part.replace("{port}", str(port)) for part in self.args]


def free_port() -> int:
    """A port nothing listens on now (the OS's choice)."""
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running(server: ServerCommand, start_timeout: float) -> Iterator[Endpoint]:
    """`server` started on a free port and ready; stopped (SIGTERM, then SIGKILL) when the block ends, however.

    A server that exits or does not answer in time is a ConfigError with the last line it wrote.
    """
    endpoint = Endpoint(HOST, free_port())
    with tempfile.TemporaryDirectory(prefix="streamchat-bench-serve-") as scratch:
        environment = dict(os.environ, **dict(server.environment))
        # streamchat's conversations go to a data directory of their own, not the user's sessions; the server
        # listens on loopback only, so the client needs no key (the user's would make every request a 401).
        environment[defaults.DATA_DIR_ENV] = str(Path(scratch) / "data")
        environment.pop(defaults.SERVE_API_KEY_ENV, None)
        log_path = Path(scratch) / "server.log"
        with log_path.open("wb") as log:
            # A session of its own: Ctrl-C in the terminal reaches the bench, which stops the server in order.
            try:
                process = subprocess.Popen(
                    server.command_line(endpoint.port),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=environment,
                    start_new_session=True,
                )
            except OSError as error:
                raise ConfigError(f"cannot start the {server.name} server: {error.strerror or error}") from None
            try:
                _wait_ready(server, endpoint, process, log_path, start_timeout)
                yield endpoint
            finally:
                _stop(process)


def _wait_ready(
    server: ServerCommand, endpoint: Endpoint, process: subprocess.Popen[bytes], log: Path, timeout: float
) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise ConfigError(f"{server.name} server exited with code {process.returncode}: {_last_line(log)}")
        if answers(endpoint, server.health_path):
            return
        if time.monotonic() > deadline:
            raise ConfigError(f"{server.name} server did not answer within {timeout:g} s: {_last_line(log)}")
        time.sleep(POLL_SECONDS)


def answers(endpoint: Endpoint, path: str) -> bool:
    """Whether GET `path` answers 200 now."""
    connection = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=2)
    try:
        connection.request("GET", path)
        return connection.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        connection.close()


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    if not lines:
        return "it wrote nothing"
    # Its own "error: ..." line goes into the bench's, which says "error:" already.
    return lines[-1].removeprefix("error:").strip()
