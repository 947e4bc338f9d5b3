"""What attention may see: which slots hold tokens, on the device, and the masks made of them.

The ledgers (ledger.py) keep the cache's bookkeeping in Python ints on the host. The
device needs part of it as tensors (Occupancy): attention masks come from which slots hold
tokens, the repetition penalty from which tokens those are, and a decode pass reads
its slots and angles from `scalars`, so that one compiled graph serves every pass.

Slots never move, so attention finds the cache's tokens through a mask rather than
through their order: a row per query, a column per slot (or per key handed over), in
the form the model's attention implementation takes.
"""

from __future__ import annotations

import torch

from streamchat.cache.ledger import Run, SinkPlacement, SlidingLedger, SlidingPlacement, StreamLedger
from streamchat.errors import CacheStateError

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
    """A pass's 4D masks (per_layer_type) from boolean masks [keys] (one query) or [queries, keys]."""

    def made(mask: torch.Tensor) -> torch.Tensor:
        return for_attention(mask if mask.dim() == 2 else mask[None], boolean, dtype)

    return per_layer_type(made(full), None if sliding is None else made(sliding), layer_types)


def per_layer_type(
    full: torch.Tensor, sliding: torch.Tensor | None, layer_types: dict[str, bool]
) -> torch.Tensor | dict[str, torch.Tensor]:
    """One mask when every layer is of one kind, else one per layer type (the models with both take a dict);
    `layer_types` says of each type whether it keeps the model's own window (and takes `sliding`)."""
    kinds = set(layer_types.values())
    if sliding is None and True in kinds:
        raise CacheStateError("layers keep the model's sliding window, but the pass has no sliding mask")
    made = {False: full} if sliding is None else {False: full, True: sliding}
    if len(kinds) == 1:
        return made[kinds.pop()]
    return {name: made[own] for name, own in layer_types.items()}


# What a decode pass reads from `Occupancy.scalars`, written by the host before the pass.
POSITION, SINK_SHIFT, WRITE, FREE, SLIDING_WRITE, SLIDING_FREE = range(6)


class Occupancy:
    """`held` [slots] and `token_ids` [slots] of the sink layers' layout, `sliding_held` of the sliding ring."""

    def __init__(self, slots: int, sliding_slots: int, device: torch.device) -> None:
        self.held = torch.zeros(slots, dtype=torch.bool, device=device)
        self.sliding_held = torch.zeros(sliding_slots, dtype=torch.bool, device=device)
        self.token_ids = torch.zeros(slots, dtype=torch.long, device=device)
        self.scalars = torch.zeros(6, dtype=torch.long, device=device)
        self.device = device

    def tensors(self) -> list[torch.Tensor]:
        return [self.held, self.sliding_held, self.token_ids, self.scalars]

    def sync(self, ledger: StreamLedger, sliding: SlidingLedger | None) -> None:
        """Mark the slots the ledgers say are held, from scratch (eager, between passes)."""
        self.held.zero_()
        self.held[: ledger.sinks_held] = True
        for start, stop in ledger.ring.held():
            self.held[ledger.sinks + start : ledger.sinks + stop] = True
        if sliding is not None:
            self.sliding_held.zero_()
            for start, stop in sliding.ring.held():
                self.sliding_held[start:stop] = True

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """The tokens token_ids [n] now sit in slots [n]."""
        self.token_ids[slots] = token_ids.to(self.device)

    def pass_masks(
        self, placement: SinkPlacement, sliding: SlidingPlacement | None, new_slots: torch.Tensor, sliding_window: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An eager pass's boolean masks, its tokens in `new_slots` [n] already held: over the sink layers' written
        slots ([slots] for one token, else chunk_mask's), and the sliding layers' (their ring for one token, else a
        banded causal mask over the old tokens the queries still see, then the new ones)."""
        incoming = new_slots.numel()
        held = self.held[: placement.extent]
        full = held if incoming == 1 else chunk_mask(held, new_slots)
        if sliding is None:
            return full, None
        if incoming == 1:
            return full, self.sliding_held[: sliding.extent]
        kept = sum(stop - start for start, stop in sliding.kept)
        return full, banded_causal(kept, incoming, sliding_window, self.device)

    def send_decode(
        self, position: int, sink_shift: int, write: int, freed: int | None, sliding: SlidingPlacement | None
    ) -> None:
        """A decode pass's position, sink shift and slots (the one it writes, the one its eviction freed if any, the
        sliding ring's), from the host without waiting for the device."""
        values = [position, sink_shift, write, write if freed is None else freed, 0, 0]
        if sliding is not None:
            values[SLIDING_WRITE] = sliding.runs[0][0]
            values[SLIDING_FREE] = sliding.freed[0][0] if sliding.freed else values[SLIDING_WRITE]
        self.scalars.copy_(torch.tensor(values), non_blocking=True)

    def take_token(self, token: torch.Tensor) -> None:
        """On the device, inside a decode pass: the freed slot leaves, token [1, 1] takes the written one."""
        scalars = self.scalars
        self.held.index_fill_(0, self.slot(FREE), False)
        self.held.index_fill_(0, self.slot(WRITE), True)
        self.token_ids.index_copy_(0, self.slot(WRITE), token.reshape(1))
        if self.sliding_held.numel():
            self.sliding_held.index_fill_(0, scalars[SLIDING_FREE : SLIDING_FREE + 1], False)
            self.sliding_held.index_fill_(0, self.slot(SLIDING_WRITE), True)

    def slot(self, which: int) -> torch.Tensor:
        """One of the scalars as a one-element index tensor."""
        return self.scalars[which : which + 1]


def slot_index(runs: list[Run] | tuple[Run, ...], device: torch.device) -> torch.Tensor:
    """The slots of `runs`, in order, as an index tensor."""
    return torch.tensor([slot for start, stop in runs for slot in range(start, stop)], device=device)
