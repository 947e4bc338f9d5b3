"""Taking a sink cache back to an earlier state: one step, one reply, or the whole state on disk.

- `Checkpoint`: the bookkeeping only. A decode step writes a free slot and evicts by
  bookkeeping alone (ledger.py), so restoring the ledgers takes such steps back exactly,
  the record of each slot's token (record.py) included; a rebase, which rotates every
  stored key, runs before a checkpoint when it is due.
- `ReplySnapshot`: what a reply can change, saved before it: the slots it may write
  (as many as it can feed tokens, not the whole cache), the sinks and the record of
  every slot's token. /regen restores it.
  A rebase rotates every slot, so one that is due runs before the snapshot and the next
  ones wait until it is released, unless the snapshot had to save every slot anyway.
- `cache_state` / `load_cache_state`: everything the cache holds, as named tensors (for
  safetensors), to resume a conversation exactly. Only slots written at least once are
  saved: the others are zeros in a new cache, as they were in this one when it was new,
  and attention never sees them (masks come from the ledgers), so a short conversation
  saves a short state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamchat.cache.layers import SinkLayer, SlidingLayer
from streamchat.cache.ledger import NO_LABEL, Ring, SlidingLedger, StreamLedger
from streamchat.cache.occupancy import slot_index
from streamchat.cache.record import SlotRecord
from streamchat.cache.sink_cache import SinkCache
from streamchat.errors import CacheStateError

STATE_VERSION = 1


@dataclass(frozen=True)
class Checkpoint:
    """The bookkeeping between two steps."""

    ledger: StreamLedger
    sliding: SlidingLedger | None

    @classmethod
    @torch.inference_mode()
    def take(cls, cache: SinkCache) -> Checkpoint:
        # A rebase rotates every stored key, which no ledger can take back: one that is due runs first.
        if cache.ledger.rebase_due:
            cache.rebase()
        return cls(cache.ledger.copy(), cache.sliding.copy() if cache.sliding else None)

    def restore(self, cache: SinkCache) -> None:
        """Take back the steps since: exact as long as none of them overwrote a held slot."""
        cache.ledger = self.ledger.copy()
        cache.sliding = self.sliding.copy() if self.sliding else None
        cache.settle()


@dataclass(frozen=True)
class ReplySnapshot:
    """The slots a reply of up to `budget` tokens can write, and the sinks, saved before it."""

    checkpoint: Checkpoint
    slots: torch.Tensor  # sink-layer slots saved
    sliding_slots: torch.Tensor | None
    saved: list[tuple[torch.Tensor, torch.Tensor] | None]  # per layer: keys, values of those slots
    pristine: list[tuple[torch.Tensor, torch.Tensor] | None]  # per sink layer: its pristine sinks
    token_ids: torch.Tensor
    record: SlotRecord

    @classmethod
    @torch.inference_mode()
    def take(cls, cache: SinkCache, budget: int) -> ReplySnapshot:
        if cache.ledger.rebase_due:
            cache.rebase()
        ring, sinks = cache.ledger.ring, cache.sinks
        every_slot = budget >= ring.slots
        runs = ring.runs(0, ring.slots) if every_slot else ring.runs(ring.next_slot, budget)
        slots = slot_index([(0, sinks), *((sinks + start, sinks + stop) for start, stop in runs)], cache.device)
        sliding_slots = None
        if cache.sliding is not None:
            sliding_ring = cache.sliding.ring
            every_slot = every_slot and budget >= sliding_ring.slots
            count = min(budget, sliding_ring.slots)
            sliding_slots = slot_index(sliding_ring.runs(sliding_ring.next_slot, count), cache.device)
        saved, pristine = [], []
        for layer in cache.layers:
            initialized = layer.is_initialized
            index = sliding_slots if isinstance(layer, SlidingLayer) else slots
            saved.append(layer.read_slots(index) if initialized else None)
            is_sink = isinstance(layer, SinkLayer) and initialized
            pristine.append((layer.pristine_sinks.clone(), layer.sink_partners.clone()) if is_sink else None)
        cache.ledger.rebase_held = not every_slot
        token_ids = cache.occupancy.token_ids.clone()
        return cls(Checkpoint.take(cache), slots, sliding_slots, saved, pristine, token_ids, cache.record.copy())

    @torch.inference_mode()
    def restore(self, cache: SinkCache) -> None:
        """Return to the state taken; the snapshot stays valid for another restore."""
        for layer, saved, pristine in zip(cache.layers, self.saved, self.pristine, strict=True):
            if saved is not None:
                layer.write_back(self.sliding_slots if isinstance(layer, SlidingLayer) else self.slots, saved)
            if pristine is not None:
                layer.pristine_sinks.copy_(pristine[0])
                layer.sink_partners.copy_(pristine[1])
        cache.occupancy.token_ids.copy_(self.token_ids)
        cache.record = self.record.copy()
        self.checkpoint.restore(cache)

    @property
    def nbytes(self) -> int:
        pairs = [pair for pair in self.saved + self.pristine if pair is not None]
        return sum(tensor.numel() * tensor.element_size() for pair in pairs for tensor in pair)


def release_snapshots(cache: SinkCache) -> None:
    """No reply snapshot will be restored any more: rebases may run again."""
    cache.ledger.rebase_held = False


def cache_state(cache: SinkCache) -> dict[str, torch.Tensor]:
    """Everything the cache holds, as named CPU tensors; load_cache_state() on a cache of the same shape restores it."""
    ledger, ring = cache.ledger, cache.ledger.ring
    numbers = [STATE_VERSION, ledger.sinks, ledger.window, ledger.sinks_held, ledger.seen, ledger.evicted]
    numbers += [ledger.position_offset, ring.head, ring.length, ring.extent]
    if cache.sliding is not None:
        sliding = cache.sliding.ring
        numbers += [cache.sliding.sliding_window, sliding.head, sliding.length, sliding.extent]
    state = {"ledger": torch.tensor(numbers), "token_ids": cache.occupancy.token_ids.cpu()}
    for index, layer in enumerate(cache.layers):
        if not layer.is_initialized:
            continue
        written = cache.sliding.ring.extent if isinstance(layer, SlidingLayer) else cache.sinks + ring.extent
        # [batch, heads, written, dim]: contiguous, as safetensors stores them.
        state[f"layers.{index}.keys"] = layer.keys[:, :, :written].contiguous().cpu()
        state[f"layers.{index}.values"] = layer.values[:, :, :written].contiguous().cpu()
        if isinstance(layer, SinkLayer):
            state[f"layers.{index}.pristine_sinks"] = layer.pristine_sinks.cpu()
    return state


@torch.inference_mode()
def load_cache_state(cache: SinkCache, state: dict[str, torch.Tensor]) -> None:
    """Put back what cache_state() saved; CacheStateError when it was saved from a cache of another shape.

    The record (record.py) takes the slots' token ids; their labels, and what was skipped, are
    the caller's to put back (SinkCache.restore_held), as a conversation saves them beside.
    """
    numbers = state["ledger"].tolist()
    if len(numbers) != (14 if cache.sliding is not None else 10):
        raise CacheStateError("the saved cache has other layer kinds than this model's")
    version, sinks, window, sinks_held, seen, evicted, offset, head, length, extent = numbers[:10]
    if version != STATE_VERSION or (sinks, window) != (cache.sinks, cache.window):
        raise CacheStateError(
            f"the saved cache is {sinks} sinks + {window} window (format {version}); "
            f"this one is {cache.sinks} + {cache.window} (format {STATE_VERSION})"
        )
    ledger = StreamLedger(sinks, window)
    ledger.sinks_held, ledger.seen, ledger.evicted, ledger.position_offset = sinks_held, seen, evicted, offset
    ledger.ring = Ring(window, head, length, extent)
    sliding = None
    if cache.sliding is not None:
        sliding_window, sliding_head, sliding_length, sliding_extent = numbers[10:14]
        sliding = SlidingLedger(sliding_window)
        sliding.ring = Ring(sliding_window, sliding_head, sliding_length, sliding_extent)
    for index, layer in enumerate(cache.layers):
        keys = state.get(f"layers.{index}.keys")
        if keys is None:
            continue
        values = state[f"layers.{index}.values"]
        if not layer.is_initialized:
            layer.lazy_initialization(keys[:, :, :1].to(cache.device), values[:, :, :1].to(cache.device))
        written = keys.shape[2]
        stored = layer.keys[:, :, :written]
        if stored.shape != keys.shape or layer.keys.dtype != keys.dtype or values.shape[:3] != keys.shape[:3]:
            raise CacheStateError(
                f"layer {index} was saved as {tuple(keys.shape)} {keys.dtype}, not {tuple(layer.keys.shape)} "
                f"{layer.keys.dtype}"
            )
        stored.copy_(keys)
        layer.values[:, :, :written].copy_(values)
        layer.keys[:, :, written:].zero_()  # as in the cache that was saved, never written (masks hide them)
        layer.values[:, :, written:].zero_()
        if isinstance(layer, SinkLayer):
            pristine = state[f"layers.{index}.pristine_sinks"].to(cache.device)
            if pristine.shape != layer.pristine_sinks.shape:
                raise CacheStateError(f"layer {index}'s sinks were saved as {tuple(pristine.shape)}")
            layer.pristine_sinks.copy_(pristine)
            layer.sink_partners.copy_(layer.rotary.partner(pristine))
    if state["token_ids"].shape != cache.occupancy.token_ids.shape:
        raise CacheStateError(f"the saved cache has {state['token_ids'].shape[0]} slots, not {cache.ledger.slots}")
    cache.occupancy.token_ids.copy_(state["token_ids"])
    cache.record = SlotRecord(state["token_ids"].tolist(), [NO_LABEL] * cache.ledger.slots)
    Checkpoint(ledger, sliding).restore(cache)
