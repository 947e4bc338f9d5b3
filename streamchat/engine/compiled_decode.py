"""A reply's decode step compiled to one graph: what the runner feeds a reply decoding alone with, when asked to.

    backend = compile_backend("auto", device)   # what --compile means here: "inductor", or None for eager steps
    step = CompiledDecode(model, backend)
    step.will_compile(cache)                    # the next step of `cache` compiles first (slow: say so)
    with cache.decode_pass(label, token_id):
        logits = step(cache, token)             # token [1, 1] -> logits [1, 1, vocab]

A decode step has fixed shapes once a cache's sinks are full, so it compiles into one graph
(CUDA graphs on a GPU, where launching a step's thousands of kernels one by one costs).
Each cache compiles once, at its first decode step: its storage and step scalars get fixed
addresses and its steps attend over every slot (the masks hide the empty ones).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.cache.feeding import model_logits
from streamchat.errors import ConfigError
from streamchat.placement.lean_forward import lean_forward_for

# A decode pass's body: (model, cache, token [1, 1]) -> logits [1, 1, vocab].
DecodeFunction = Callable[[Any, SinkCache, torch.Tensor], torch.Tensor]


def decode_logits(model: Any, cache: SinkCache, token: torch.Tensor) -> torch.Tensor:
    """The body of `with cache.decode_pass()` for token [1, 1]: logits [1, 1, vocab]. Compilable."""
    return model_logits(model, cache, token, cache.decode_inputs(token))


def decode_function(model: Any) -> DecodeFunction:
    """decode_logits, or the same pass through the lean forward where the model has one (placement/lean_forward.py)."""
    forward = lean_forward_for(model)
    if forward is None:
        return decode_logits

    def lean_decode(model: Any, cache: SinkCache, token: torch.Tensor) -> torch.Tensor:
        inputs = cache.decode_inputs(token)
        return forward(token, inputs.position_ids, inputs.attention_mask, cache)

    return lean_decode


class CompiledDecode:
    """One decode step of a cache, compiled with `backend`; how long the last first step took to compile."""

    def __init__(self, model: Any, backend: str) -> None:
        self.model = model
        self.device = model.get_input_embeddings().weight.device
        mode = "reduce-overhead" if self.device.type == "cuda" and backend == "inductor" else None
        self._step = torch.compile(decode_function(model), backend=backend, mode=mode, fullgraph=True, dynamic=False)
        self._compiled: weakref.WeakSet[SinkCache] = weakref.WeakSet()
        self.seconds: float | None = None  # how long the last cache's first step took (compiling it)

    def will_compile(self, cache: SinkCache) -> bool:
        """Whether `cache`'s next step compiles first: its sinks are full and it never stepped compiled."""
        return cache.ledger.sinks_full and cache not in self._compiled

    def __call__(self, cache: SinkCache, token: torch.Tensor) -> torch.Tensor:
        """Inside `cache.decode_pass()`: the logits [1, 1, vocab] after token [1, 1], in a buffer the next call
        reuses (copy what is kept)."""
        if cache in self._compiled:
            if self.device.type == "cuda":
                # Tells CUDA graph trees that the last step's outputs are done with: the replay may reuse them.
                torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call]  # unannotated in torch
            return self._step(self.model, cache, token)
        cache.static_extent = True
        cache.mark_static()
        started = time.perf_counter()
        logits = self._step(self.model, cache, token)
        self.seconds = time.perf_counter() - started
        self._compiled.add(cache)
        return logits


def compile_backend(setting: str, device: torch.device) -> str | None:
    """What --compile auto|on|off means on `device`: a torch.compile backend, or None for eager steps.

    auto compiles on CUDA, where a step is thousands of kernel launches that CUDA graphs
    replay at once. Not on the CPU, as measured (README, Benchmarks): the compiled lean step
    of the default model is 5 % faster at a full cache (16.3 against 17.2 ms a token) and
    slower with a short prompt, and the first start compiles for 47 s on two cores, which a
    chat wins back only after about 50,000 tokens.
    """
    if setting not in defaults.COMPILE_SETTINGS:
        raise ConfigError(f"--compile {setting!r}: choose one of {', '.join(defaults.COMPILE_SETTINGS)}")
    if setting == "auto":
        return "inductor" if device.type == "cuda" else None
    return "inductor" if setting == "on" else None
