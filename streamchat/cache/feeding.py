"""Feed any number of tokens through a sink cache, in chunks, evicting as it goes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple

import torch

from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.cache.sink_cache import SinkCache, StepInputs
from streamchat.errors import CacheConfigError


class Forwarded(NamedTuple):
    """One forward pass through the cache: its logits, and what the cache evicted to make room."""

    logits: torch.Tensor  # [1, n, vocab] with all_logits, else the last position's [1, 1, vocab]
    eviction: Eviction | None


class FedChunk(NamedTuple):
    """One chunk of a longer feed: its ids [1, c], the logits after it and what it evicted."""

    ids: torch.Tensor
    logits: torch.Tensor
    eviction: Eviction | None


def chunk_sizes(total: int, cache: SinkCache, chunk_size: int) -> Iterator[int]:
    """Chunk lengths that feed `total` tokens; none is longer than the window or `chunk_size`."""
    if chunk_size < 1:
        raise CacheConfigError(f"chunk_size={chunk_size}: must be >= 1")
    step = min(chunk_size, cache.window)
    fed = 0
    while fed < total:
        size = min(step, total - fed)
        yield size
        fed += size


def prefill_chunks(
    model: Any,
    cache: SinkCache,
    input_ids: torch.Tensor,
    chunk_size: int,
    all_logits: bool = False,
    label: int = NO_LABEL,
) -> Iterator[FedChunk]:
    """Feed input_ids [1, n], recorded with `label`; yield each chunk with its logits, as forward() returns
    them, and its eviction."""
    start = 0
    for size in chunk_sizes(input_ids.shape[-1], cache, chunk_size):
        chunk = input_ids[:, start : start + size]
        yield FedChunk(chunk, *forward(model, cache, chunk, all_logits, label))
        start += size


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
    return model(
        input_ids=input_ids,
        cache=cache,
        position_ids=inputs.position_ids,
        attention_mask=inputs.attention_mask,
        use_cache=True,
        logits_to_keep=0 if all_logits else 1,
    ).logits
