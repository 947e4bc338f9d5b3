"""Who a rank is, where it computes, how long it waits; joining a group of two CPU processes."""

import sys

import pytest

from streamchat import defaults
from streamchat.distributed.group import Ranks, device_type, first_line, ranks_from_env, step_timeout
from streamchat.distributed.supervisor import supervise
from streamchat.errors import ConfigError

# A rank that joins after `delay` seconds with a 0.5 s step timeout, waits `pause` seconds,
# takes one step, and writes how the step went to `folder`/rank<N>.
RANK = """
import os, pathlib, sys, time
import torch, torch.distributed as dist
from streamchat.distributed.group import join_group, leave_group, ranks_from_env
from streamchat.distributed.lockstep import lost_ranks_reported
from streamchat.errors import PeerLostError
ranks = ranks_from_env(os.environ)
delay, pause = (float(value) for value in sys.argv[2 + ranks.rank].split())
time.sleep(delay)
join_group(ranks, "cpu", 0.5)
time.sleep(pause)
try:
    with lost_ranks_reported(ranks.rank, "taking a step"):
        dist.broadcast(torch.zeros(1), src=0)
    outcome = "stepped"
except PeerLostError as error:
    outcome = str(error)
pathlib.Path(sys.argv[1], f"rank{ranks.rank}").write_text(outcome)
leave_group()
"""


def steps_of_two_ranks(folder, rank_0, rank_1):
    """Each rank's outcome (None if the launcher ended it first), for (delay, pause) of rank 0 and of rank 1."""
    command = [sys.executable, "-c", RANK, str(folder), *(f"{delay} {pause}" for delay, pause in (rank_0, rank_1))]
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
    assert steps_of_two_ranks(tmp_path, rank_0=(2, 0), rank_1=(0, 0)) == ["stepped", "stepped"]


@pytest.mark.multiprocess
def test_once_joined_a_rank_later_than_the_step_timeout_is_given_up_on(tmp_path):
    rank_0, _ = steps_of_two_ranks(tmp_path, rank_0=(0, 0), rank_1=(0, 3))
    assert rank_0.startswith("rank 0 lost the other ranks while taking a step: Timed out waiting 500ms"), rank_0


# Two ranks take a step, then their teardown fails (as it can when a peer is gone), then they end.
QUIET_END = """
import os, sys
import torch, torch.distributed as dist
from streamchat.distributed.group import join_group, leave_group_and_exit, ranks_from_env
join_group(ranks_from_env(os.environ), "cpu", 30)
dist.broadcast(torch.zeros(1), src=0)
def failing_teardown():
    raise RuntimeError("Connection closed by peer")
dist.destroy_process_group = failing_teardown
leave_group_and_exit(int(os.environ["RANK"]) + 3)
"""


@pytest.mark.multiprocess
def test_a_follower_whose_teardown_failed_still_ends_at_once_with_its_code():
    lines = []
    assert supervise(2, [sys.executable, "-c", QUIET_END], lines.append) == 3
    assert lines == []
