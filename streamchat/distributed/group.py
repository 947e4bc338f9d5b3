"""Joining a tensor-parallel run: this process's rank, and the process groups the ranks talk through.

Two groups, because the ranks wait for two kinds of things:

- the default group (NCCL on CUDA, gloo on CPU) carries the model's own collectives and
  each step's token; a rank that waits longer than the step timeout there gives up;
- a gloo group carries rank 0's requests (a turn, a command, exit). Between two requests
  rank 0 waits for the user, maybe for days, so its timeout is long. A rank that dies
  closes its TCP connections, and gloo raises at once in the ranks waiting on it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, NoReturn

from streamchat import defaults
from streamchat.errors import ConfigError, RankLostError

# Set by torchrun (and by the --tp N launcher) in every rank's environment.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")


@dataclass(frozen=True)
class Ranks:
    """Which rank this process is, of how many; local_rank picks its GPU on its machine."""

    rank: int
    world_size: int
    local_rank: int

    @property
    def leads(self) -> bool:
        """Rank 0 owns the terminal, the journal and the draws."""
        return self.rank == 0


def ranks_from_env(env: Mapping[str, str]) -> Ranks | None:
    """This process's place in a torchrun launch; None outside one."""
    if not all(env.get(name) for name in RANK_VARIABLES):
        return None
    try:
        rank, world_size, local_rank = (int(env[name]) for name in RANK_VARIABLES)
    except ValueError:
        raise ConfigError(
            "torchrun's RANK, WORLD_SIZE and LOCAL_RANK must be whole numbers, got "
            + ", ".join(f"{name}={env[name]!r}" for name in RANK_VARIABLES)
        ) from None
    return Ranks(rank, world_size, local_rank)


def step_timeout(env: Mapping[str, str]) -> float:
    """Seconds a rank waits for the others within one step: $STREAMCHAT_TP_STEP_TIMEOUT, else the default."""
    raw = env.get(defaults.TP_STEP_TIMEOUT_ENV)
    if not raw:
        return float(defaults.TP_STEP_TIMEOUT_SECONDS)
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not seconds > 0:
        raise ConfigError(f"{defaults.TP_STEP_TIMEOUT_ENV}={raw!r}: must be a number of seconds > 0")
    return seconds


def device_type(device: str, cuda_devices: int) -> str:
    """Where the ranks compute: one GPU each on CUDA (NCCL), else the CPU (gloo)."""
    if device in ("auto", "cuda"):
        if cuda_devices:
            return "cuda"
        if device == "cuda":
            raise ConfigError("--device cuda: torch sees no CUDA GPU here; use --device auto or --device cpu")
        return "cpu"
    if device == "cpu":
        return "cpu"
    raise ConfigError(
        f"--device {device} cannot be used with --tp, which gives each rank its own GPU: use auto, cuda or cpu"
    )


@dataclass(frozen=True)
class Group:
    """The joined run: this rank, its device, and the gloo group rank 0's requests travel through."""

    ranks: Ranks
    device: Any  # torch.device
    requests: Any  # torch.distributed.ProcessGroup


def join_group(ranks: Ranks, device: str, timeout_seconds: float) -> Group:
    """Initialise torch.distributed (the rendezvous torchrun's environment names) and the request group."""
    import torch
    import torch.distributed as dist

    if device == "cuda":
        torch.cuda.set_device(ranks.local_rank)
        where = torch.device("cuda", ranks.local_rank)
    else:
        where = torch.device("cpu")
    try:
        # The rendezvous waits as long as ranks take to start; each step then waits only the step timeout.
        store, _, _ = next(
            dist.rendezvous(
                "env://", ranks.rank, ranks.world_size, timeout=timedelta(seconds=defaults.TP_JOIN_TIMEOUT_SECONDS)
            )
        )
        dist.init_process_group(
            "nccl" if device == "cuda" else "gloo",
            store=store,
            rank=ranks.rank,
            world_size=ranks.world_size,
            timeout=timedelta(seconds=timeout_seconds),
        )
        requests = dist.new_group(backend="gloo", timeout=timedelta(seconds=defaults.TP_REQUEST_TIMEOUT_SECONDS))
    except (RuntimeError, ValueError) as error:
        raise RankLostError(
            f"rank {ranks.rank} could not join the other {ranks.world_size - 1} "
            f"(rendezvous at {os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}): "
            f"{first_line(error)}"
        ) from None
    return Group(ranks, where, requests)


def leave_group() -> None:
    """Tear the process groups down (quietly: the others may be gone already)."""
    import torch.distributed as dist

    if dist.is_initialized():
        with suppress(Exception):  # leaving must not fail because a peer left first
            dist.destroy_process_group()


def leave_group_and_exit(code: int) -> NoReturn:
    """A rank's end after a clean run: leave the groups, then exit at once, without the interpreter's
    finalization.

    Finalizing with gloo's threads still alive (a teardown that failed quietly, as it does when a
    peer left first) can hang the process or abort it (SIGABRT), which the launcher reports as this
    rank's failure: the leader's too (a piped run under --tp 2 ended "rank 0 was killed by SIGABRT"
    once in a full test run). By then every file a rank writes is closed or synced record by record,
    so skipping finalization loses nothing but what stdout and stderr still buffer, flushed here.
    """
    leave_group()
    for stream in (sys.stdout, sys.stderr):
        with suppress(Exception):  # a closed pipe: nobody to tell
            stream.flush()
    os._exit(code)


def first_line(error: BaseException) -> str:
    """An exception's first line, without the C++ source location gloo and NCCL put in front."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text
