"""Who a rank is, where it computes, how long it waits: pure rules, no process group."""

import pytest

from streamchat import defaults
from streamchat.distributed.group import Ranks, device_type, first_line, ranks_from_env, step_timeout
from streamchat.errors import ConfigError


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
