"""`streamchat run --tp`: one conversation, N processes in lockstep (streamchat/distributed).

    torchrun --nproc-per-node N -m streamchat run --tp ...   # torchrun starts the ranks (several machines too)
    streamchat run --tp N ...                                 # streamchat starts N ranks on this machine

Every rank loads its shard of the model. Rank 0 takes rank 0's configuration to every
rank, then runs the usual chat or transcript loop through a LeaderSession; the others
follow it and print nothing.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import warnings
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, NoReturn

import typer

from streamchat import defaults
from streamchat.errors import ConfigError, PeerLostError
from streamchat.interface.config import RunConfig, load_options
from streamchat.interface.reporting import stderr
from streamchat.loading import LoadedModel, LoadOptions


def with_optional_tp_value(arguments: list[str]) -> list[str]:
    """`--tp` followed by nothing or by another option means `--tp auto` (click has no optional values)."""
    given = list(arguments)
    for index, argument in enumerate(given):
        if argument == "--tp" and (index + 1 == len(given) or given[index + 1].startswith("-")):
            given.insert(index + 1, defaults.TP_AUTO)
            break
    return given


def wants_tensor_parallel(config: RunConfig) -> bool:
    return config.tp is not None and config.tp != 1


def run_tensor_parallel(config: RunConfig, load: Callable[[LoadOptions], LoadedModel]) -> int:
    """Launch the ranks (--tp N outside torchrun), or be one of them."""
    from streamchat.distributed.group import ranks_from_env
    from streamchat.placement.tensor_parallel import ensure_no_device_map, tensor_parallel_quantization

    # Refused here, before any process starts or joins.
    ensure_no_device_map(config.device_map)
    tensor_parallel_quantization(config.quantize)
    ranks = ranks_from_env(os.environ)
    if ranks is None:
        if config.tp == defaults.TP_AUTO:
            raise ConfigError(
                "--tp without a number joins the processes torchrun started, and this is not one: run "
                "`torchrun --nproc-per-node N -m streamchat run --tp ...`, or give --tp N to start N here"
            )
        if not isinstance(config.tp, int):  # None: wants_tensor_parallel(config) was not asked first
            raise ConfigError("tensor parallelism needs --tp N, a number of ranks")
        from streamchat.interface.reporting import notify
        from streamchat.loading.loader import check_shardable

        # Once, here: the ranks find the files in place, and a model they cannot shard is refused once.
        check_shardable(dataclasses.replace(load_options(config), tp_size=config.tp), notify)
        return _launch(config.tp)
    if config.tp not in (defaults.TP_AUTO, ranks.world_size):
        raise ConfigError(f"--tp {config.tp}: torchrun started {ranks.world_size} processes; give --tp alone")
    return _run_rank(config, ranks, load)


def _launch(world_size: int) -> int:
    from streamchat.distributed.supervisor import supervise

    def report(text: str) -> None:
        with suppress(OSError):
            stderr.print(f"[bold red]error:[/] {text}", highlight=False)

    return supervise(world_size, [sys.executable, "-m", "streamchat", *sys.argv[1:]], report)


def _run_rank(config: RunConfig, ranks: Any, load: Callable[[LoadOptions], LoadedModel]) -> NoReturn:
    import torch

    from streamchat.distributed.group import device_type, join_group, leave_group_and_exit, step_timeout

    if not ranks.leads:
        _silenced()
    where = device_type(config.device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    group = join_group(ranks, where, step_timeout(os.environ))
    # Torn down only after a clean end: after a failure a peer may be gone or hung, and tearing the
    # groups down would wait for it; this process's exit closes its connections anyway.
    leave_group_and_exit(_as_rank(config, ranks, group, load))


def _as_rank(config: RunConfig, ranks: Any, group: Any, load: Callable[[LoadOptions], LoadedModel]) -> int:
    from streamchat.app.launch import run_chat
    from streamchat.distributed.follower import follow
    from streamchat.distributed.leader import LeaderSession
    from streamchat.distributed.lockstep import Lockstep
    from streamchat.sessions.building import driven_session_for, driver_for, session_for

    lockstep = Lockstep(group)
    config = _shared_config(config, lockstep)
    if config.compile == "auto":
        # Compiling a sharded model's step (CUDA graphs around NCCL collectives) has not been tried: eager.
        config = dataclasses.replace(config, compile="off")
    _files_everywhere(config, lockstep)

    def load_shard(options: LoadOptions) -> LoadedModel:
        return load(dataclasses.replace(options, tp_size=ranks.world_size))

    if not ranks.leads:
        follow(driven_session_for(config, load_shard(load_options(config)), channel=lockstep), lockstep)
        return 0
    leader: LeaderSession | None = None

    def build(config: RunConfig, loaded: LoadedModel) -> tuple[LeaderSession, None]:
        nonlocal leader
        leader = LeaderSession(session_for(config, loaded, channel=lockstep), driver_for(config, loaded), lockstep)
        return leader, None  # no cache states: each rank holds a shard of the cache

    try:
        return _reported_by_launcher(lambda: run_chat(config, load_shard, build))
    finally:
        if leader is not None:
            leader.close()


def _shared_config(config: RunConfig, lockstep: Any) -> RunConfig:
    """Rank 0's configuration on every rank: the others' config files and environments may differ."""
    import torch.distributed as dist

    from streamchat.distributed.lockstep import lost_ranks_reported

    box: list[Any] = [config if lockstep.leads else None]
    with lost_ranks_reported(lockstep.rank, "starting"):
        dist.broadcast_object_list(box, src=0, group=lockstep.group.requests)
    return box[0]


class _PeerFailed(BaseException):
    """The launcher says another rank failed (a BaseException, so that no loop mistakes it for its own error)."""


def _peer_failed(signum: int, frame: Any) -> None:
    raise _PeerFailed


def _files_everywhere(config: RunConfig, lockstep: Any) -> None:
    """Every rank fetches or converts the model's files, then waits (as long as it takes) for the others."""
    import torch.distributed as dist

    from streamchat.distributed.lockstep import lost_ranks_reported
    from streamchat.interface.reporting import notify
    from streamchat.loading.loader import fetch_model_files

    fetch_model_files(load_options(config), notify if lockstep.leads else lambda text: None)
    with lost_ranks_reported(lockstep.rank, "waiting for every rank to have the model's files"):
        dist.barrier(group=lockstep.group.requests)


def _reported_by_launcher(run: Callable[[], int]) -> int:
    """Under the --tp N launcher, a lost peer is the launcher's to report (it knows which rank, and why)."""
    report = os.environ.get(defaults.TP_REPORT_ENV)
    if not report:
        return run()
    from streamchat.distributed.supervisor import PEER_FAILED_SIGNAL

    signal.signal(PEER_FAILED_SIGNAL, _peer_failed)
    try:
        return run()
    except PeerLostError as error:
        with suppress(OSError):
            Path(report).write_text(str(error))
        raise typer.Exit(error.exit_code) from None
    except _PeerFailed:
        raise typer.Exit(PeerLostError.exit_code) from None


def _silenced() -> None:
    """A follower prints nothing: stdout goes nowhere, warnings are dropped, the terminal's keys are rank 0's.

    Its stderr stays, for the one line of its own failure (the launcher reads it).
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    warnings.simplefilter("ignore")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops rank 0's reply; rank 0 tells the others
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # ended by torchrun or the launcher: no last words
    with suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        transformers_logging.set_verbosity_error()
        transformers_logging.disable_progress_bar()
