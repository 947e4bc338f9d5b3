"""Feed any number of tokens through a sink cache, in chunks, evicting as it goes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from streamchat.cache.sink_cache import SinkCache
from streamchat.errors import CacheConfigError


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
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Feed input_ids [1, n]; yield (chunk ids [1, c], logits) per chunk, as forward() returns them."""
    start = 0
    for size in chunk_sizes(input_ids.shape[-1], cache, chunk_size):
        chunk = input_ids[:, start : start + size]
        yield chunk, forward(model, cache, chunk, all_logits)
        start += size


def forward(model: Any, cache: SinkCache, input_ids: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
    """One forward pass of input_ids [1, n] through the cache (which evicts what does not fit).

    Returns logits [1, n, vocab] with `all_logits`, else only the last position's [1, 1, vocab].
    """
    # The cache's storage is made and written under inference mode, so every step runs under it.
    with torch.inference_mode():
        inputs = cache.begin_step(input_ids)
        logits = model(
            input_ids=input_ids,
            cache=cache,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            use_cache=True,
            logits_to_keep=0 if all_logits else 1,
        ).logits
    cache.finish_step()
    return logits
