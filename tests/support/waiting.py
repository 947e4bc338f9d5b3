"""How a test waits for a process it started: for what it expects, never against a budget a busy machine misses.

A test waits for a condition: the output it expects, a file, a port that answers, the
process's exit. A process that ends first ends the wait at once, and the test fails with
what it wrote on stderr. HANG_GUARD_SECONDS ends only a wait that would otherwise never
end (a hung process); it is far past the slowest plausible run on a loaded machine, so it
never decides whether a test passes. $STREAMCHAT_TEST_HANG_GUARD sets another, in seconds.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable

import pytest

HANG_GUARD_ENV = "STREAMCHAT_TEST_HANG_GUARD"
HANG_GUARD_SECONDS = float(os.environ.get(HANG_GUARD_ENV) or 900)
_POLL_SECONDS = 0.02


def read_at_least(process: subprocess.Popen, count: int) -> bytes:
    """`count` bytes or more of the process's stdout, read from its descriptor (communicate() reads there later).

    A process that closes its stdout first (it ended) fails the test with its stderr.
    """
    data = b""
    while len(data) < count:
        chunk = os.read(process.stdout.fileno(), count - len(data))
        if not chunk:
            ended_early(process, f"after {len(data)} of the {count} bytes awaited on stdout: {data!r}")
        data += chunk
    return data


def ended_early(process: subprocess.Popen, what: str) -> None:
    """Fail the test: the process ended (or closed its stdout) before it did what the test waited for."""
    try:
        _, errors = process.communicate(timeout=HANG_GUARD_SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        _, errors = process.communicate()
    if isinstance(errors, bytes):
        errors = errors.decode(errors="replace")
    pytest.fail(f"the process ended with code {process.returncode} {what}; its stderr:\n{errors or ''}")


def wait_until(condition: Callable[[], bool], what: str, process: subprocess.Popen | None = None) -> None:
    """Poll `condition` until it holds. If `process` ends first, fail at once with its stderr."""
    give_up = time.monotonic() + HANG_GUARD_SECONDS
    while not condition():
        if process is not None and process.poll() is not None:
            ended_early(process, f"before {what}")
        if time.monotonic() > give_up:
            pytest.fail(f"still waiting, after {HANG_GUARD_SECONDS:g} s, for {what}: something hangs")
        time.sleep(_POLL_SECONDS)
