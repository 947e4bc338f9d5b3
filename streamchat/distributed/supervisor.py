"""`streamchat run --tp N`: start N ranks on this machine, and end them all when one ends.

The launcher does what torchrun does for one machine (the rendezvous environment, one
process per rank), and what a chat needs besides:

- rank 0 keeps the terminal: its stdin, stdout and stderr, and the foreground process
  group, so Ctrl-C reaches it alone (the launcher ignores SIGINT; the other ranks run in
  sessions of their own and print nothing: their stderr is kept for the report);
- SIGTERM and SIGHUP to the launcher go on to rank 0, which ends the turn and then tells
  the others to exit;
- when a rank dies, the others are ended within TP_EXIT_GRACE_SECONDS, and one line
  says which rank and why: its signal, or its own one-line error;
- every rank dies with the launcher (Linux's parent-death signal): never an orphan.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from streamchat import defaults
from streamchat.errors import PeerLostError, RankLostError

POLL_SECONDS = 0.05
# How long the launcher waits, after a rank lost its peers, for the rank that caused it to exit.
CAUSE_WAIT_SECONDS = 2.0
# What the launcher sends rank 0 when another rank failed: end now, and leave the report to the launcher.
PEER_FAILED_SIGNAL = signal.SIGUSR1
# Linux prctl option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1


@dataclass
class _Rank:
    rank: int
    process: subprocess.Popen[bytes]
    stderr: IO[bytes] | None  # a temporary file (followers); None: rank 0 writes to the terminal

    def last_line(self) -> str:
        if self.stderr is None:
            return ""
        self.stderr.seek(0)
        lines = [line.strip() for line in self.stderr.read().decode(errors="replace").splitlines() if line.strip()]
        return lines[-1] if lines else ""


def free_port() -> int:
    """A TCP port free on the loopback interface right now, for the rendezvous."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def rank_environment(base: dict[str, str], rank: int, world_size: int, port: int, report: Path) -> dict[str, str]:
    """What torchrun would set for `rank` of `world_size` on one machine, plus where rank 0 reports."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    env[defaults.TP_REPORT_ENV] = str(report)
    # N ranks on one machine share its cores (torchrun sets 1; a CPU rank does better with its share).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))
    return env


def supervise(world_size: int, command: Sequence[str], report_line: Callable[[str], None]) -> int:
    """Run `command` (`python -m streamchat run ... --tp N`) as `world_size` ranks; return the run's exit code.

    `report_line(text)` prints the one line that says which rank ended the run, and why.
    """
    command = list(command)
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    with tempfile.TemporaryDirectory(prefix="streamchat-tp-") as scratch:
        report = Path(scratch) / "report"
        env = rank_environment(dict(os.environ), 0, world_size, free_port(), report)
        ranks: list[_Rank] = []
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's: it stops the reply
            for rank in range(world_size):
                ranks.append(_start(command, {**env, "RANK": str(rank), "LOCAL_RANK": str(rank)}, rank, scratch))
            leader = ranks[0].process

            def forward(signum: int, frame: object) -> None:
                with contextlib.suppress(ProcessLookupError):
                    leader.send_signal(signum)

            signal.signal(signal.SIGTERM, forward)
            signal.signal(signal.SIGHUP, forward)
            # Ctrl-C at a terminal reaches rank 0 directly (its foreground process group); a `kill -INT` is passed on.
            signal.signal(signal.SIGINT, signal.SIG_IGN if _terminal_interrupts_rank_0() else forward)
            code, why = _watch(ranks, report)
        finally:
            for started in ranks:
                _end(started.process)
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            for started in ranks:
                if started.stderr is not None:
                    started.stderr.close()
    if why is not None:
        report_line(why)  # after every rank has ended: the last line on the terminal
    return code


def _start(command: list[str], env: dict[str, str], rank: int, scratch: str) -> _Rank:
    if rank == 0:
        # The terminal's: stdin, stdout, stderr and the foreground process group. Dies with a hangup.
        process = subprocess.Popen(command, env=env, preexec_fn=_as_rank_0)
        return _Rank(rank, process, None)
    stderr = open(Path(scratch) / f"rank{rank}.err", "w+b")  # noqa: SIM115 - closed by supervise
    process = subprocess.Popen(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,  # no terminal signals: rank 0 tells it what to do
        preexec_fn=_dies_with_parent(signal.SIGKILL),
    )
    return _Rank(rank, process, stderr)


def _as_rank_0() -> None:
    # The launcher ignores SIGINT, and an ignored signal survives exec: Ctrl-C is rank 0's to handle.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    arrange = _dies_with_parent(signal.SIGHUP)
    if arrange is not None:
        arrange()


def _terminal_interrupts_rank_0() -> bool:
    """Whether a Ctrl-C typed at this terminal is delivered to rank 0 already (it shares our process group)."""
    try:
        return os.tcgetpgrp(sys.stdin.fileno()) == os.getpgrp()
    except (OSError, ValueError):
        return False


def _dies_with_parent(signum: int) -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None

    def arrange() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signum))

    return arrange


def _watch(ranks: list[_Rank], report: Path) -> tuple[int, str | None]:
    """Wait for rank 0 to end, or another rank to fail; the run's exit code, and why it ended when a rank failed.

    A follower exits 0 only when rank 0 told it to: that may come a moment before rank 0 itself ends.
    """
    leader = ranks[0].process
    while leader.poll() is None and not any(rank.process.poll() for rank in ranks[1:]):
        time.sleep(POLL_SECONDS)
    code = leader.returncode
    if code is not None and code >= 0 and code != PeerLostError.exit_code:
        # Rank 0 ended the run (or failed, and said so itself): the others were told to exit.
        _wait_all(ranks[1:], defaults.TP_EXIT_GRACE_SECONDS)
        return _exit_code(code), None
    # A rank failed or hung: give the rank that caused it a moment to show (its exit, rank 0's own report).
    _wait_all(ranks, CAUSE_WAIT_SECONDS, until=lambda: _cause(ranks) is not None)
    cause = _cause(ranks)
    _wait_all(ranks[:1], CAUSE_WAIT_SECONDS)  # rank 0 ends by itself when a step fails, or when it errs too
    code = leader.poll()
    if cause is None and code is not None and code >= 0 and code != PeerLostError.exit_code:
        # Rank 0 ended the run by itself (cleanly, interrupted, or with its own one-line error): a follower
        # that lost it a moment before (still reading the exit when rank 0's connections closed) lost nothing
        # the run needed, and which of the two exits the launcher saw first must not change the run's code.
        return code, None
    if cause is not None and code is not None and code > 0 and code != PeerLostError.exit_code:
        return code, None  # every rank met the same error (a model --tp cannot split): rank 0 said it
    why = _why(cause, report) if cause is not None else _hung(ranks, report)
    if cause is not None and code is None:
        # Rank 0 waits for the user, or in a step it will give up on: end it now, quietly (the line says why).
        with contextlib.suppress(ProcessLookupError):
            leader.send_signal(PEER_FAILED_SIGNAL)
        _wait_all(ranks[:1], defaults.TP_EXIT_GRACE_SECONDS)
    cause_code = cause.process.returncode if cause is not None else None
    if cause_code is not None and 0 < cause_code < 128:
        return cause_code, why  # the rank failed: its own code
    return RankLostError.exit_code, why


def _cause(ranks: list[_Rank]) -> _Rank | None:
    """A rank that ended for a reason of its own: killed, or failed (not because it lost the others)."""
    for rank in ranks[1:]:
        code = rank.process.poll()
        if code is not None and code not in (0, PeerLostError.exit_code):
            return rank
    leader = ranks[0].process.poll()
    if leader is not None and leader < 0:
        return ranks[0]  # rank 0 was killed: its followers lose it
    return None


def _hung(ranks: list[_Rank], report: Path) -> str:
    """Why the run ended when no rank failed by itself: some stopped answering, and the others gave up on them."""
    silent = [rank.rank for rank in ranks if rank.process.poll() is None]
    if ranks[0].process.poll() is None:
        noticed = next((rank.last_line() for rank in ranks[1:] if rank.last_line()), "")
    else:
        noticed = report.read_text(errors="replace").strip() if report.is_file() else ""
    who = " and ".join(f"rank {rank}" for rank in silent) or "a rank"
    return f"{who} stopped answering" + (f" ({noticed.removeprefix('error: ')})" if noticed else "")


def _why(rank: _Rank, report: Path) -> str:
    code = rank.process.returncode
    if code is not None and code < 0:
        return f"rank {rank.rank} was killed by {signal.Signals(-code).name}; every rank stopped"
    said = rank.last_line().removeprefix("error: ")
    if said:
        return said if said.startswith(f"rank {rank.rank}") else f"rank {rank.rank}: {said}"
    return f"rank {rank.rank} exited with code {code}; every rank stopped"


def _wait_all(ranks: list[_Rank], seconds: float, until: Callable[[], bool] | None = None) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if all(rank.process.poll() is not None for rank in ranks) or (until is not None and until()):
            return
        time.sleep(POLL_SECONDS)


def _end(process: subprocess.Popen[bytes]) -> None:
    """Terminate, then kill after the grace period: no rank outlives the launcher."""
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        process.terminate()
        process.send_signal(signal.SIGCONT)  # a stopped (hung) rank handles SIGTERM only once it runs again
    try:
        process.wait(defaults.TP_EXIT_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()


def _exit_code(code: int | None) -> int:
    return 128 - code if code is not None and code < 0 else (code or 0)
