"""The --tp N launcher on stand-in ranks (small Python scripts): who ended the run, the one line, no orphans."""

import os
import sys

import psutil
import pytest

from streamchat import defaults
from streamchat.distributed import supervisor
from streamchat.distributed.supervisor import free_port, rank_environment, supervise
from streamchat.errors import OutOfMemoryError, PeerLostError, RankLostError
from tests.support.waiting import HANG_GUARD_SECONDS

pytestmark = pytest.mark.multiprocess

# Each stand-in rank runs the line for its RANK; rank 0 writes its pid where the test can find it.
SCRIPT = """
import os, pathlib, signal, sys, time
rank = int(os.environ["RANK"])
pathlib.Path(sys.argv[1], f"rank{rank}.pid").write_text(str(os.getpid()))
exec(sys.argv[2 + rank])
"""
# A stand-in rank that never ends by itself: it writes rank<N>.finished only if it was left to finish.
LINGERS = f"time.sleep({HANG_GUARD_SECONDS}); pathlib.Path(sys.argv[1], f'rank{{rank}}.finished').touch()"


def after(marker: str, then: str) -> str:
    """A stand-in rank's code: wait until `marker` (a file in the test's folder) exists, then run `then`."""
    return f"while not pathlib.Path(sys.argv[1], {marker!r}).exists(): time.sleep(0.01)\n{then}"


def once_rank_1_is_gone(then: str) -> str:
    """Rank 0's code: wait until rank 1 has exited and the launcher has seen it (reaped it), then run `then`."""
    return after(
        "rank1.pid",
        "import psutil\n"
        "pid = pathlib.Path(sys.argv[1], 'rank1.pid').read_text()\n"
        "while not pid or psutil.pid_exists(int(pid)):\n"
        "    time.sleep(0.01)\n"
        "    pid = pathlib.Path(sys.argv[1], 'rank1.pid').read_text()\n" + then,
    )


def run(tmp_path, *per_rank):
    lines = []
    code = supervise(len(per_rank), [sys.executable, "-c", SCRIPT, str(tmp_path), *per_rank], lines.append)
    return code, lines


def pids(tmp_path):
    return [int(path.read_text()) for path in sorted(tmp_path.glob("rank*.pid"))]


def assert_all_gone(tmp_path):
    for pid in pids(tmp_path):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_rank_that_is_killed_ends_the_run_in_one_line_naming_it(tmp_path):
    code, lines = run(tmp_path, LINGERS, "time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)")
    assert code == RankLostError.exit_code
    assert lines == ["rank 1 was killed by SIGKILL; every rank stopped"]
    assert not (tmp_path / "rank0.finished").exists()  # rank 0 was ended, not waited for
    assert_all_gone(tmp_path)


def test_a_rank_that_fails_is_reported_by_its_own_line_and_exit_code(tmp_path):
    failing = "print('error: rank 1: out of memory on cuda:1 while generating', file=sys.stderr); sys.exit(6)"
    code, lines = run(tmp_path, LINGERS, failing)
    assert code == OutOfMemoryError.exit_code
    assert lines == ["rank 1: out of memory on cuda:1 while generating"]


def test_rank_0_ending_the_run_ends_it_quietly_with_its_exit_code(tmp_path):
    code, lines = run(tmp_path, "time.sleep(0.3); sys.exit(7)", "time.sleep(0.1)")
    assert (code, lines) == (7, [])


@pytest.mark.parametrize("ends", [0, 130], ids=["cleanly", "interrupted"])
def test_a_follower_that_loses_rank_0_as_it_ends_leaves_the_run_rank_0_s_exit_code(tmp_path, ends):
    # Rank 1 reads the exit as rank 0's connections close: it exits "lost rank 0" a moment before rank 0 ends
    # (Ctrl-C under load saw it): the launcher sees rank 1's exit first, and the run is rank 0's all the same.
    code, lines = run(tmp_path, once_rank_1_is_gone(f"sys.exit({ends})"), f"sys.exit({PeerLostError.exit_code})")
    assert (code, lines) == (ends, [])
    assert_all_gone(tmp_path)


def test_a_rank_that_stops_answering_is_named_with_what_rank_0_saw(tmp_path):
    report = (
        f"pathlib.Path(os.environ['{defaults.TP_REPORT_ENV}']).write_text('rank 0 lost the other ranks: timed out')"
    )
    code, lines = run(tmp_path, f"{report}; sys.exit({PeerLostError.exit_code})", LINGERS)
    assert code == RankLostError.exit_code
    assert lines == ["rank 1 stopped answering (rank 0 lost the other ranks: timed out)"]
    assert_all_gone(tmp_path)


def test_the_ranks_get_torchruns_environment_on_a_free_loopback_port(tmp_path):
    port = free_port()
    env = rank_environment({"OMP_NUM_THREADS": "3"}, 1, 2, port, tmp_path / "report")
    assert {key: env[key] for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")} == {
        "RANK": "1",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    assert env["OMP_NUM_THREADS"] == "3"  # the user's choice stands
    assert env[defaults.TP_REPORT_ENV] == str(tmp_path / "report")
    assert os.environ.get("RANK") is None  # the launcher's own environment is untouched


def test_an_error_every_rank_meets_is_said_once_by_rank_0(tmp_path, monkeypatch):
    # Rank 1 fails first; rank 0 meets the same error once the launcher has seen rank 1 go, and the
    # launcher waits for rank 0 to end by itself (here as long as it takes: a busy machine decides nothing).
    monkeypatch.setattr(supervisor, "CAUSE_WAIT_SECONDS", HANG_GUARD_SECONDS)
    refused = "print('error: --tp 2: 9 heads do not split', file=sys.stderr); sys.exit(2)"
    code, lines = run(tmp_path, once_rank_1_is_gone(refused), refused)
    assert (code, lines) == (2, [])


def test_when_rank_0_stops_answering_the_line_says_so_with_what_another_rank_saw(tmp_path):
    gave_up = (
        f"print('error: rank 1 lost the other ranks: timed out', file=sys.stderr); sys.exit({PeerLostError.exit_code})"
    )
    deaf = "signal.signal(signal.SIGTERM, signal.SIG_IGN); pathlib.Path(sys.argv[1], 'deaf').touch(); " + LINGERS
    code, lines = run(tmp_path, deaf, after("deaf", gave_up))
    assert code == RankLostError.exit_code
    assert lines == ["rank 0 stopped answering (rank 1 lost the other ranks: timed out)"]
    assert not (tmp_path / "rank0.finished").exists()  # rank 0 ignored SIGTERM: it was killed after the grace period
    assert_all_gone(tmp_path)
