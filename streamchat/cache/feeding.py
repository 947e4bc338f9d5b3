"""The model's own forward through a sink cache, one pass at a time.

model_logits is the body of an open pass (the engine's runner's and its compiled decode's); forward
opens the pass around it, for every position's logits (the perplexity measure's scoring) or as a
reference the engine's runner is tested against. A prompt the chat reads goes through the
engine's runner instead (generation/requests.py: Reading, read_prompt).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.cache.sink_cache import PassInputs, SinkCache


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
    with cache.forward_pass(input_ids, label) as opened:
        logits = model_logits(model, cache, input_ids, opened.inputs, all_logits)
    return Forwarded(logits, opened.eviction)


def model_logits(
    model: Any, cache: Any, input_ids: torch.Tensor, inputs: PassInputs, all_logits: bool = False
) -> torch.Tensor:
    """The model's forward over input_ids [rows, n] inside an open pass of `cache` (a SinkCache, or a CacheBatch
    for decode rows), at the positions and under the masks the pass handed over: logits [rows, n, vocab] with
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
