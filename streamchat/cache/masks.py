"""Attention masks over the cache's slots, as the model's attention implementation takes them.

Slots never move, so attention finds the cache's tokens through a mask rather than
through their order: a row per query, a column per slot (or per key handed over).
"""

from __future__ import annotations

import torch

# The name streamchat's own attention (placement/attention.py) is registered under in transformers.
STREAMCHAT_ATTENTION = "streamchat"

# How each attention implementation the sink cache runs with takes a mask: sdpa and
# streamchat's a boolean one (True: attend), eager one added to the scores.
BOOLEAN_MASK_ATTENTION = frozenset({"sdpa", STREAMCHAT_ATTENTION})


def chunk_mask(held: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
    """[queries, slots]: every query sees the slots `held` [slots] marks, except new tokens after itself.

    `held` includes the chunk's own tokens, which sit in `new_slots` [queries] in order.
    """
    queries = new_slots.numel()
    mask = held.expand(queries, -1).clone()
    causal = torch.ones(queries, queries, dtype=torch.bool, device=held.device).tril()
    mask[:, new_slots] = causal
    return mask


def banded_causal(kept: int, incoming: int, window: int, device: torch.device) -> torch.Tensor:
    """[incoming, kept + incoming] for keys laid out as `kept` old tokens then the new ones, in stream order.

    Query i sees key j when j is not after it and at most `window - 1` tokens before it.
    """
    queries = torch.arange(incoming, device=device)[:, None] + kept
    keys = torch.arange(kept + incoming, device=device)[None, :]
    distance = queries - keys
    return (distance >= 0) & (distance < window)


def for_attention(mask: torch.Tensor, boolean: bool, dtype: torch.dtype) -> torch.Tensor:
    """A [queries, keys] boolean mask as the 4D mask [1, 1, queries, keys] the attention takes."""
    mask = mask[None, None]
    if boolean:
        return mask
    attend = torch.zeros((), dtype=dtype, device=mask.device)
    return torch.where(mask, attend, torch.finfo(dtype).min)


def for_layers(
    full: torch.Tensor,
    sliding: torch.Tensor | None,
    layer_types: dict[str, bool],
    boolean: bool,
    dtype: torch.dtype,
) -> torch.Tensor | dict[str, torch.Tensor]:
    """A step's 4D masks (per_layer_type) from boolean masks [keys] (one query) or [queries, keys]."""

    def made(mask: torch.Tensor) -> torch.Tensor:
        return for_attention(mask if mask.dim() == 2 else mask[None], boolean, dtype)

    return per_layer_type(made(full), None if sliding is None else made(sliding), layer_types)


def per_layer_type(
    full: torch.Tensor, sliding: torch.Tensor | None, layer_types: dict[str, bool]
) -> torch.Tensor | dict[str, torch.Tensor]:
    """One mask when every layer is of one kind, else one per layer type (the models with both take a dict);
    `layer_types` says of each type whether it keeps the model's own window (and takes `sliding`)."""
    made = {False: full, True: sliding}
    kinds = set(layer_types.values())
    if len(kinds) == 1:
        return made[kinds.pop()]
    return {name: made[own] for name, own in layer_types.items()}
