"""How many aten operators a decode step calls: what the Python around the kernels costs, counted.

A decode step of a small model is thousands of small operators, each with its dispatch
and Python around it. torch.profiler sees them in eager steps and in compiled ones alike
(what a compiled graph still runs as aten calls: extern kernels, the code around the
graph). Counted outside any timed trial: the profiler slows what it watches.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from streamchat.cache import SinkCache
from streamchat.generation.decoder import Decoder
from streamchat.generation.requests import endless_reply, read_prompt
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings

# Steps before counting (the first compiles) and steps counted.
WARM_UP_STEPS = 2
COUNTED_STEPS = 4


def aten_calls(run: Callable[[], None]) -> int:
    """aten operators `run` calls from Python or a compiled graph: those not called by another aten operator."""
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as profiled:
        run()
    return sum(
        1 for event in profiled.events() if event.name.startswith("aten::") and not _inside_aten(event.cpu_parent)
    )


def decode_aten_calls_per_token(
    model: Any, ids: torch.Tensor, sinks: int, window: int, compile_backend: str | None = None
) -> int:
    """aten calls per greedy decode step of streamchat's token loop after the prompt ids [1, n], read as the chat
    reads one."""
    cache = SinkCache.for_model(model, sinks, window)
    decoder = Decoder(cache)
    decoder.start(read_prompt(model, cache, ids[0].tolist()), GenerationSettings(temperature=0.0), Sampler(0))
    next_token = endless_reply(model, decoder, compile_backend)
    for _ in range(WARM_UP_STEPS):
        next_token()

    def steps() -> None:
        for _ in range(COUNTED_STEPS):
            next_token()

    return round(aten_calls(steps) / COUNTED_STEPS)


def _inside_aten(parent: Any) -> bool:
    return parent is not None and parent.name.startswith("aten::")


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """No profiler start/stop notes on the terminal: some torch builds print them to file descriptor 2."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
