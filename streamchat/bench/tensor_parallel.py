"""`streamchat bench speed --tp N`: decode ms/token with the model sharded over N processes, against one.

Outside torchrun, the command first measures one process (the whole model here), then
starts N ranks (streamchat.distributed.supervisor) that measure the same reply together:
greedy, `steps` tokens after a warm-up reply, through the chat's own lockstep (rank 0
draws and broadcasts each token). Under torchrun only the N-process figure is printed.
On one CPU the processes share its cores: a smoke test, not a scaling figure.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

from streamchat.errors import ConfigError
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.loading import LoadedModel, LoadOptions

PROMPT = "Tell me a long story about a lighthouse keeper."
WARMUP_TOKENS = 8


@dataclass(frozen=True)
class DecodeSpeed:
    processes: int
    backend: str  # "one process", "gloo" or "nccl"
    device: str
    tokens: int  # decode steps timed
    ms_per_token: float

    def line(self) -> str:
        how = "1 process" if self.processes == 1 else f"{self.processes} processes ({self.backend})"
        return f"decode {self.ms_per_token:.2f} ms/token · {how} on {self.device} · {self.tokens} tokens"


def tp_speed(
    world_size: str,
    options: LoadOptions,
    window: int,
    steps: int,
    load: Callable[[LoadOptions], LoadedModel],
    say: Callable[[str], None],
    random_init: str | None = None,
) -> int:
    """Measure one process, then `world_size` (or join torchrun's ranks and measure those); the exit code."""
    from streamchat.distributed.group import ranks_from_env

    if random_init is not None:
        raise ConfigError("--tp loads --model's weights sharded: give --model instead of --random-init")
    options = dataclasses.replace(options, quantize="none")  # --tp shards unquantized weights
    ranks = ranks_from_env(os.environ)
    if ranks is None:
        if not world_size.isdigit() or int(world_size) < 2:
            raise ConfigError(f"--tp {world_size}: give the number of processes (2 or more) to measure")
        say(measure(load(options), window, steps).line())
        from streamchat.distributed.supervisor import supervise

        return supervise(int(world_size), [sys.executable, "-m", "streamchat", *sys.argv[1:]], say)
    return _as_rank(ranks, options, window, steps, load, say)


def _as_rank(ranks: Any, options: LoadOptions, window: int, steps: int, load: Callable, say: Callable) -> NoReturn:
    import torch

    from streamchat.distributed.follower import follow
    from streamchat.distributed.group import device_type, join_group, leave_group_and_exit, step_timeout
    from streamchat.distributed.leader import LeaderSession
    from streamchat.distributed.lockstep import Lockstep

    where = device_type(options.device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    group = join_group(ranks, where, step_timeout(os.environ))
    lockstep = Lockstep(group)
    loaded = load(dataclasses.replace(options, tp_size=ranks.world_size))
    session = _session(loaded, window, steps, lockstep)
    if not ranks.leads:
        follow(session, lockstep)
        leave_group_and_exit(0)
    leader = LeaderSession(session, lockstep)
    try:
        speed = measure(loaded, window, steps, leader)
    finally:
        leader.close()
    backend = "nccl" if where == "cuda" else "gloo"
    say(dataclasses.replace(speed, processes=ranks.world_size, backend=backend).line())
    leave_group_and_exit(0)  # only after a clean end (see app/tensor_parallel.py)


def _session(loaded: LoadedModel, window: int, steps: int, channel: Any = None) -> Any:
    from streamchat.conversation.session import ChatSession, SessionOptions

    settings = GenerationSettings(max_new_tokens=steps + 1, temperature=0.0, stop=())
    return ChatSession(
        loaded.model, loaded.tokenizer, SessionOptions(window=window, settings=settings, channel=channel, recall="off")
    )


def measure(loaded: LoadedModel, window: int, steps: int, session: Any = None) -> DecodeSpeed:
    """A warm-up reply, then a timed one of `steps` decode steps (fewer if the model ends it)."""
    session = session or _session(loaded, window, steps)
    session.update_settings(max_new_tokens=WARMUP_TOKENS)
    _finished(session.chat(PROMPT))
    session.update_settings(max_new_tokens=steps + 1)  # the first token comes from the prompt's logits
    stats = _finished(session.chat(PROMPT)).stats
    tokens = stats.generated_tokens - 1
    per_token = 1000 * stats.decode_seconds / tokens if tokens > 0 else float("nan")
    return DecodeSpeed(1, "one process", str(loaded.device), tokens, per_token)


def _finished(events: Any) -> TurnFinished:
    finished = None
    for event in events:
        if isinstance(event, TurnFinished):
            finished = event
    return finished
