"""The model's own forward through a sink cache, one step at a time.

step_logits is the body of an open step (the runner's and the compiled step's, engine/); forward
opens the step around it, for every position's logits (the perplexity measure's scoring) or as a
reference the engine's runner is tested against. A prompt the chat reads goes through the
engine's runner instead (generation/prompt_reading.py: Reading, read_prompt).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.cache.sink_cache import SinkCache, StepInputs


class Forwarded(NamedTuple):
    """One forward pass through the cache: its logits, and what the cache evicted to make room."""

    logits: torch.Tensor  # [1, n, vocab] with all_logits, else the last position's [1, 1, vocab]
    eviction: Eviction | None


def forward(
    model: Any, cache: SinkCache, input_ids: torch.Tensor, all_logits: bool = False, label: int = NO_LABEL
) -> Forwarded:
    """One forward pass of input_ids [1, n] through the cache, which evicts what does not fit and records
    the tokens with `label` (streamchat.cache.record: what the model sees, and what each token came with).

    Returns the logits ([1, n, vocab] with `all_logits`, else the last position's [1, 1, vocab])
    and the eviction that made room for the pass (None when nothing had to leave).
    """
    with cache.step(input_ids, label) as step:
        logits = step_logits(model, cache, input_ids, step.inputs, all_logits)
    return Forwarded(logits, step.eviction)


def step_logits(
    model: Any, cache: Any, input_ids: torch.Tensor, inputs: StepInputs, all_logits: bool = False
) -> torch.Tensor:
    """The model's forward over input_ids [rows, n] inside an open step of `cache` (a SinkCache, or a CacheBatch
    for decode rows), at the positions and under the masks the step handed over: logits [rows, n, vocab] with
    `all_logits`, else the last position's [rows, 1, vocab]. Compilable."""
    logits: torch.Tensor = model(
        input_ids=input_ids,
        cache=cache,
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,
        use_cache=True,
        logits_to_keep=0 if all_logits else 1,
    ).logits
    return logits
