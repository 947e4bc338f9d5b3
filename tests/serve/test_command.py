"""`streamchat serve` on the command line: what it refuses before anything loads or binds."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from streamchat.cli import app
from streamchat.serve.command import is_loopback


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.20", "::", "example.org"])
def test_a_host_others_can_reach_needs_an_api_key(host: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STREAMCHAT_API_KEY", raising=False)
    result = CliRunner().invoke(app, ["serve", "--host", host, "--model", "/nonexistent/model"])
    assert result.exit_code == 2
    assert result.output.count("\n") == 1
    assert f"--host {host} is reachable from other machines: give an --api-key" in result.output


def test_a_key_from_the_environment_is_enough_to_get_past_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STREAMCHAT_API_KEY", "s3cret")
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0", "--model", "/nonexistent/model"])
    # Past the check, the model is what fails to load: nothing was bound.
    assert "reachable from other machines" not in result.output and result.exit_code != 0


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.8.9.1", True), ("::1", True), ("localhost", True), ("10.0.0.1", False)],
)
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback
