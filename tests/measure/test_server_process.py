"""A benchmark's server subprocess: ready when it answers, stopped however the block ends, its failure said."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from streamchat.errors import ConfigError
from streamchat.measure import server_process
from streamchat.measure.server_process import ServerCommand, answers, running
from tests.support.waiting import HANG_GUARD_SECONDS


class ClockStoppedUntil:
    """The clock the readiness wait reads: it stands still until `path` exists, then is a day on.

    A start budget then runs out only after the server did what the test needs it to have done,
    however long a busy machine took to start it.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.reads = 0
        self.give_up = time.monotonic() + HANG_GUARD_SECONDS

    def monotonic(self) -> float:
        self.reads += 1  # the first read starts the budget
        moved_on = self.reads > 1 and (self.path.exists() or time.monotonic() > self.give_up)
        return 86_400.0 if moved_on else 0.0

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(seconds)


def test_a_server_is_stopped_when_the_block_fails(tmp_path) -> None:
    server = ServerCommand(
        "static", (sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "-d", str(tmp_path)), "/"
    )
    with pytest.raises(RuntimeError), running(server, start_timeout=HANG_GUARD_SECONDS) as endpoint:
        assert answers(endpoint, "/")
        raise RuntimeError("the bench failed")
    assert not answers(endpoint, "/")


def test_a_server_that_never_answers_is_stopped_and_said(tmp_path, monkeypatch) -> None:
    said = tmp_path / "said"
    # It says it is loading, marks that it said so, and never answers.
    script = "import pathlib, sys, time; print('still loading', flush=True); pathlib.Path(sys.argv[1]).touch()"
    script += "; time.sleep(600)"
    server = ServerCommand("silent", (sys.executable, "-c", script, str(said)), "/health")
    monkeypatch.setattr(server_process, "time", ClockStoppedUntil(said))
    failure = r"silent server did not answer within 0.5 s: still loading"
    with pytest.raises(ConfigError, match=failure), running(server, start_timeout=0.5):
        pass


def test_a_server_that_cannot_start_is_said(tmp_path) -> None:
    server = ServerCommand("missing", (str(tmp_path / "no-such-binary"),), "/health")
    failure = "cannot start the missing server: No such file or directory"
    with pytest.raises(ConfigError, match=failure), running(server, start_timeout=5):
        pass
