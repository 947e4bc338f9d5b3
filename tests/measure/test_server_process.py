"""A benchmark's server subprocess: ready when it answers, stopped however the block ends, its failure said."""

from __future__ import annotations

import sys

import pytest

from streamchat.errors import ConfigError
from streamchat.measure.server_process import ServerCommand, answers, running


def test_a_server_is_stopped_when_the_block_fails(tmp_path) -> None:
    server = ServerCommand(
        "static", (sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "-d", str(tmp_path)), "/"
    )
    with pytest.raises(RuntimeError), running(server, start_timeout=20) as endpoint:
        assert answers(endpoint, "/")
        raise RuntimeError("the bench failed")
    assert not answers(endpoint, "/")


def test_a_server_that_never_answers_is_stopped_and_said(tmp_path) -> None:
    script = "import time; print('still loading', flush=True); time.sleep(60)"
    server = ServerCommand("silent", (sys.executable, "-c", script), "/health")
    failure = r"silent server did not answer within 0.5 s: still loading"
    with pytest.raises(ConfigError, match=failure), running(server, start_timeout=0.5):
        pass


def test_a_server_that_cannot_start_is_said(tmp_path) -> None:
    server = ServerCommand("missing", (str(tmp_path / "no-such-binary"),), "/health")
    failure = "cannot start the missing server: No such file or directory"
    with pytest.raises(ConfigError, match=failure), running(server, start_timeout=5):
        pass
