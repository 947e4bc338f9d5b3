"""Who a rank is, where it computes, how long it waits; joining a group of two CPU processes."""

import sys

import pytest

from streamchat import defaults
from streamchat.distributed.group import Ranks, device_type, first_line, ranks_from_env, step_timeout
from streamchat.distributed.supervisor import supervise
from streamchat.errors import ConfigError
from tests.support.waiting import HANG_GUARD_SECONDS

# The step timeout of the ranks below: long enough that two ranks let go at once arrive together
# on a busy machine too, short enough to wait out in a test.
STEP_TIMEOUT = 2.0

# A rank that says it is joining, runs its first line, joins with STEP_TIMEOUT, runs its second
# line, takes one step, and writes how the step went to `folder`/rank<N>. `wait_for(name)` waits
# until the file `folder`/name exists.
RANK = """
import os, pathlib, sys, time
import torch, torch.distributed as dist
from streamchat.distributed.group import join_group, leave_group, ranks_from_env
from streamchat.distributed.lockstep import lost_ranks_reported
from streamchat.errors import PeerLostError
ranks = ranks_from_env(os.environ)
folder = pathlib.Path(sys.argv[1])
def wait_for(name):
    while not (folder / name).exists():
        time.sleep(0.01)
before_joining, before_stepping = sys.argv[3 + 2 * ranks.rank : 5 + 2 * ranks.rank]
(folder / f"rank{ranks.rank}.joining").touch()
exec(before_joining)
join_group(ranks, "cpu", float(sys.argv[2]))
exec(before_stepping)
try:
    with lost_ranks_reported(ranks.rank, "taking a step"):
        dist.broadcast(torch.zeros(1), src=0)
    outcome = "stepped"
except PeerLostError as error:
    outcome = str(error)
(folder / f"rank{ranks.rank}").write_text(outcome)
leave_group()
"""


def steps_of_two_ranks(folder, rank_0=("", ""), rank_1=("", "")):
    """Each rank's outcome (None if the launcher ended it first).

    `rank_0` and `rank_1`: the line that rank runs before it joins, and the one before it steps.
    """
    command = [sys.executable, "-c", RANK, str(folder), str(STEP_TIMEOUT), *rank_0, *rank_1]
    supervise(2, command, lambda line: None)
    return [path.read_text() if path.exists() else None for path in (folder / "rank0", folder / "rank1")]


def test_ranks_come_from_torchruns_environment():
    assert ranks_from_env({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1"}) == Ranks(3, 4, 1)
    assert ranks_from_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}).leads
    assert ranks_from_env({}) is None
    assert ranks_from_env({"RANK": "0", "WORLD_SIZE": "2"}) is None  # not torchrun: LOCAL_RANK missing


def test_a_malformed_rank_is_named():
    with pytest.raises(ConfigError, match="RANK='one'"):
        ranks_from_env({"RANK": "one", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})


def test_the_step_timeout_is_the_default_or_the_environments():
    assert step_timeout({}) == defaults.TP_STEP_TIMEOUT_SECONDS
    assert step_timeout({defaults.TP_STEP_TIMEOUT_ENV: "2.5"}) == 2.5
    with pytest.raises(ConfigError, match=r"STREAMCHAT_TP_STEP_TIMEOUT='-1': must be a number of seconds > 0"):
        step_timeout({defaults.TP_STEP_TIMEOUT_ENV: "-1"})


def test_each_rank_gets_a_gpu_when_there_are_some_else_the_cpu():
    assert device_type("auto", 2) == "cuda"
    assert device_type("auto", 0) == "cpu"
    assert device_type("cpu", 2) == "cpu"
    with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA GPU"):
        device_type("cuda", 0)
    with pytest.raises(ConfigError, match="--device mps cannot be used with --tp"):
        device_type("mps", 0)
    with pytest.raises(ConfigError, match="--device cuda:1 cannot be used with --tp"):
        device_type("cuda:1", 2)


def test_a_collectives_message_loses_its_source_location():
    error = RuntimeError("[/pytorch/third_party/gloo/transport/tcp/pair.cc:553] Connection closed by peer\nmore")
    assert first_line(error) == "Connection closed by peer"
    assert first_line(RuntimeError()) == "RuntimeError"


@pytest.mark.multiprocess
def test_a_rank_that_starts_later_than_the_step_timeout_still_joins(tmp_path):
    # Rank 0 joins once rank 1 has been joining for longer than the step timeout.
    late = f"wait_for('rank1.joining'); time.sleep({2 * STEP_TIMEOUT})"
    assert steps_of_two_ranks(tmp_path, rank_0=(late, "")) == ["stepped", "stepped"]


@pytest.mark.multiprocess
def test_once_joined_a_rank_later_than_the_step_timeout_is_given_up_on(tmp_path):
    # Rank 1 steps only once rank 0 has said how its step went: rank 0 waits for it in vain.
    rank_0, _ = steps_of_two_ranks(tmp_path, rank_1=("", "wait_for('rank0')"))
    waited = f"{STEP_TIMEOUT * 1000:.0f}ms"
    assert rank_0.startswith(f"rank 0 lost the other ranks while taking a step: Timed out waiting {waited}"), rank_0


# Two ranks take a step, then their teardown fails (as it can when a peer is gone), then they end.
QUIET_END = """
import os, sys
import torch, torch.distributed as dist
from streamchat.distributed.group import join_group, leave_group_and_exit, ranks_from_env
join_group(ranks_from_env(os.environ), "cpu", float(sys.argv[1]))
dist.broadcast(torch.zeros(1), src=0)
def failing_teardown():
    raise RuntimeError("Connection closed by peer")
dist.destroy_process_group = failing_teardown
leave_group_and_exit(int(os.environ["RANK"]) + 3)
"""


@pytest.mark.multiprocess
def test_a_follower_whose_teardown_failed_still_ends_at_once_with_its_code():
    lines = []
    assert supervise(2, [sys.executable, "-c", QUIET_END, str(HANG_GUARD_SECONDS)], lines.append) == 3
    assert lines == []
