"""A sink cache as it was at one moment: one snapshot type, to go back to it or to save it.

    CacheSnapshot.take(cache)             the bookkeeping: takes back decode passes (a guessed token)
    CacheSnapshot.take(cache, reach=n)    and the slots n tokens can write: takes back a reply (/regen)
    CacheSnapshot.whole(cache)            every slot written: parks a conversation
    snapshot.restore(cache)               back to it; the snapshot stays valid for another restore
    snapshot.tensors()                    a whole one as named CPU tensors, for safetensors
    CacheSnapshot.from_tensors(t, cache)  read back, checked against the cache before it writes anything

A decode pass writes a free slot and evicts by bookkeeping alone (ledger.py), so restoring
the ledgers takes such passes back exactly, the record of each slot's token (record.py)
included. A longer run of tokens can overwrite held slots: the snapshot saves as many slots
as the run can write (not the whole cache), the sinks and the record.

A rebase rotates every stored key, which no ledger can take back: one that is due runs
before a snapshot, and, while a snapshot of some slots may be restored, the next ones wait
(release_snapshots() lets them run again). A whole snapshot saves only the slots written at
least once: the others are zeros in a new cache, as they were in this one when it was new,
and attention never sees them (masks come from the ledgers), so a short conversation saves
a short state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamchat.cache.layers import SinkLayer, SlidingLayer
from streamchat.cache.ledger import NO_LABEL, Ring, SlidingLedger, StreamLedger
from streamchat.cache.masks import slot_index
from streamchat.cache.quantized_kv import FULL, INT8, KV_FORMATS, KVFormat
from streamchat.cache.record import SlotRecord
from streamchat.cache.sink_cache import SinkCache
from streamchat.errors import CacheStateError

STATE_VERSION = 1

# A layer's slot tensors at the saved slots [batch, heads, saved slots, dim] (keys, values, an int8 cache's
# scales), then an int8 sink layer's exact sinks [batch, heads, sinks, dim] (layers.py: read_slots).
SavedLayer = tuple[torch.Tensor, ...]


@dataclass(frozen=True)
class SavedSlots:
    """The contents of some slots: each layer's keys and values there, the sinks, and which token each slot holds."""

    index: torch.Tensor  # [n] the sink layers' slots saved
    sliding_index: torch.Tensor | None  # [m] the sliding layers'
    layers: list[SavedLayer | None]  # per layer; None where the layer had never been written
    pristine: list[torch.Tensor | None]  # per sink layer: its sinks before rotation (their partners follow)
    token_ids: torch.Tensor  # [slots] the occupancy's token per slot (the repetition penalty reads it)
    record: SlotRecord
    every: bool  # every slot written: on restore, slots past them are zeros, as in a new cache


@dataclass(frozen=True)
class CacheSnapshot:
    """The ledgers between two passes, and the contents of the slots that what follows may write."""

    ledger: StreamLedger
    sliding: SlidingLedger | None
    slots: SavedSlots | None = None
    kv_format: KVFormat = FULL  # how the saved slots store keys and values

    @classmethod
    @torch.inference_mode()
    def take(cls, cache: SinkCache, reach: int = 0) -> CacheSnapshot:
        """The cache before passes that feed at most `reach` tokens (0: decode passes, taken back one at a time)."""
        if cache.ledger.rebase_due:
            cache.rebase()
        if reach == 0:
            return cls(*_copies(cache.ledger, cache.sliding))
        ring, sinks = cache.ledger.ring, cache.sinks
        saves_all = reach >= ring.slots
        runs = ring.runs(0, ring.slots) if saves_all else ring.runs(ring.next_slot, reach)
        index = slot_index([(0, sinks), *((sinks + start, sinks + stop) for start, stop in runs)], cache.device)
        sliding_index = None
        if cache.sliding is not None:
            sliding_ring = cache.sliding.ring
            saves_all = saves_all and reach >= sliding_ring.slots
            sliding_runs = sliding_ring.runs(sliding_ring.next_slot, min(reach, sliding_ring.slots))
            sliding_index = slot_index(sliding_runs, cache.device)
        cache.ledger.rebase_held = not saves_all  # a rebase would rotate slots this snapshot did not save
        return cls._with_slots(cache, index, sliding_index, every=False)

    @classmethod
    @torch.inference_mode()
    def whole(cls, cache: SinkCache) -> CacheSnapshot:
        """Everything the cache holds: every slot written at least once."""
        return cls._with_slots(cache, *_written_slots(cache.ledger, cache.sliding, cache.device), every=True)

    @classmethod
    def _with_slots(
        cls, cache: SinkCache, index: torch.Tensor, sliding_index: torch.Tensor | None, every: bool
    ) -> CacheSnapshot:
        layers: list[SavedLayer | None] = []
        pristine: list[torch.Tensor | None] = []
        for layer in cache.ring_layers:
            if not layer.is_initialized:
                layers.append(None)
                pristine.append(None)
                continue
            layers.append(layer.read_slots(_layer_index(layer, index, sliding_index)))
            pristine.append(layer.pristine_sinks.clone() if isinstance(layer, SinkLayer) else None)
        token_ids = cache.occupancy.token_ids.clone()
        slots = SavedSlots(index, sliding_index, layers, pristine, token_ids, cache.record.copy(), every)
        return cls(*_copies(cache.ledger, cache.sliding), slots, cache.kv_format)

    @torch.inference_mode()
    def restore(self, cache: SinkCache) -> None:
        """Return `cache` to the moment taken: exact, as nothing since overwrote a slot the snapshot did not save."""
        if self.slots is not None:
            _write_slots(cache, self.slots)
        cache.ledger, cache.sliding = _copies(self.ledger, self.sliding)
        cache.settle()

    @property
    def nbytes(self) -> int:
        """The bytes of slot contents the snapshot keeps."""
        if self.slots is None:
            return 0
        tensors = [t for pair in self.slots.layers if pair is not None for t in pair]
        tensors += [t for t in self.slots.pristine if t is not None]
        return sum(tensor.numel() * tensor.element_size() for tensor in tensors)

    def tensors(self) -> dict[str, torch.Tensor]:
        """A whole snapshot as named CPU tensors; from_tensors() on a cache of the same shape reads it back."""
        if self.slots is None or not self.slots.every:
            raise CacheStateError("only a whole snapshot of a cache can be saved (CacheSnapshot.whole)")
        ledger, ring = self.ledger, self.ledger.ring
        numbers = [STATE_VERSION, ledger.sinks, ledger.window, ledger.sinks_held, ledger.seen, ledger.evicted]
        numbers += [ledger.position_offset, ring.head, ring.length, ring.extent]
        if self.sliding is not None:
            sliding = self.sliding.ring
            numbers += [self.sliding.sliding_window, sliding.head, sliding.length, sliding.extent]
        state = {"ledger": torch.tensor(numbers), "token_ids": self.slots.token_ids.cpu()}
        state["kv_format"] = torch.tensor([KV_FORMATS.index(self.kv_format)])
        for index, (saved, pristine) in enumerate(zip(self.slots.layers, self.slots.pristine, strict=True)):
            if saved is None:
                continue
            for name, tensor in zip(_saved_names(self.kv_format, pristine is not None), saved, strict=True):
                state[f"layers.{index}.{name}"] = tensor.contiguous().cpu()
            if pristine is not None:
                state[f"layers.{index}.pristine_sinks"] = pristine.cpu()
        return state

    @classmethod
    def from_tensors(cls, state: dict[str, torch.Tensor], cache: SinkCache) -> CacheSnapshot:
        """What tensors() saved, for `cache`; CacheStateError when it was saved from a cache of another shape.

        The record takes the slots' token ids; their labels, and what was skipped, are the
        caller's to put back after restore() (SinkCache.restore_held), as a conversation saves them beside.
        """
        ledger, sliding = _ledgers(state["ledger"].tolist(), cache)
        saved_format = KV_FORMATS[int(state["kv_format"][0])] if "kv_format" in state else FULL
        if saved_format != cache.kv_format:
            raise CacheStateError(f"the saved cache's KV window is {saved_format}; this one's is {cache.kv_format}")
        index, sliding_index = _written_slots(ledger, sliding, cache.device)
        layers: list[SavedLayer | None] = []
        pristine: list[torch.Tensor | None] = []
        for number, layer in enumerate(cache.ring_layers):
            keys = state.get(f"layers.{number}.keys")
            if keys is None:
                layers.append(None)
                pristine.append(None)
                continue
            written = len(_layer_index(layer, index, sliding_index))
            saved = _checked_layer(number, layer, state, written)
            layers.append(tuple(tensor.to(cache.device) for tensor in saved))
            sinks = _checked_pristine(number, layer, state, keys) if isinstance(layer, SinkLayer) else None
            pristine.append(None if sinks is None else sinks.to(cache.device))
        token_ids = state["token_ids"]
        if token_ids.shape != cache.occupancy.token_ids.shape:
            raise CacheStateError(f"the saved cache has {token_ids.shape[0]} slots, not {cache.ledger.slots}")
        record = SlotRecord(token_ids.tolist(), [NO_LABEL] * cache.ledger.slots)
        slots = SavedSlots(index, sliding_index, layers, pristine, token_ids.to(cache.device), record, every=True)
        return cls(ledger, sliding, slots, cache.kv_format)


def release_snapshots(cache: SinkCache) -> None:
    """No snapshot of some slots will be restored any more: rebases may run again."""
    cache.ledger.rebase_held = False


def _copies(ledger: StreamLedger, sliding: SlidingLedger | None) -> tuple[StreamLedger, SlidingLedger | None]:
    return ledger.copy(), sliding.copy() if sliding else None


def _written_slots(
    ledger: StreamLedger, sliding: SlidingLedger | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The slots written at least once, of the sink layers [sinks + extent] and of the sliding ones."""
    index = torch.arange(ledger.sinks + ledger.ring.extent, device=device)
    return index, None if sliding is None else torch.arange(sliding.ring.extent, device=device)


def _write_slots(cache: SinkCache, slots: SavedSlots) -> None:
    for layer, saved, pristine in zip(cache.ring_layers, slots.layers, slots.pristine, strict=True):
        if saved is None:
            continue
        if not layer.is_initialized:
            layer.initialize_like(saved, cache.mask_dtype)
        index = _layer_index(layer, slots.index, slots.sliding_index)
        layer.write_back(index, saved)
        if slots.every:  # as in the cache the snapshot was taken from when it was new: never written
            for tensor in layer.slot_tensors():
                tensor[:, :, len(index) :].zero_()
        if pristine is not None:
            if not isinstance(layer, SinkLayer):
                raise CacheStateError("sinks were saved for a layer that has none")
            layer.pristine_sinks.copy_(pristine)
            layer.sink_partners.copy_(layer.rotary.partner(pristine))
    cache.occupancy.token_ids.copy_(slots.token_ids)
    cache.record = slots.record.copy()


def _layer_index(
    layer: SinkLayer | SlidingLayer, index: torch.Tensor, sliding_index: torch.Tensor | None
) -> torch.Tensor:
    """The slots of `layer` among the sink layers' `index` and the sliding layers' `sliding_index`."""
    if not isinstance(layer, SlidingLayer):
        return index
    if sliding_index is None:
        raise CacheStateError("a sliding layer's slots were not saved")
    return sliding_index


def _ledgers(numbers: list[int], cache: SinkCache) -> tuple[StreamLedger, SlidingLedger | None]:
    """The ledgers a saved state's numbers describe, checked against `cache`'s shape."""
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
    if cache.sliding is None:
        return ledger, None
    sliding_window, sliding_head, sliding_length, sliding_extent = numbers[10:14]
    sliding = SlidingLedger(sliding_window)
    sliding.ring = Ring(sliding_window, sliding_head, sliding_length, sliding_extent)
    return ledger, sliding


def _saved_names(kv_format: KVFormat, sink_layer: bool) -> tuple[str, ...]:
    """What a saved state names a layer's saved tensors (SavedLayer's order)."""
    if kv_format != INT8:
        return ("keys", "values")
    return ("keys", "values", "key_scales", "value_scales", *(("sink_keys", "sink_values") if sink_layer else ()))


def _checked_layer(
    number: int, layer: SinkLayer | SlidingLayer, state: dict[str, torch.Tensor], written: int
) -> SavedLayer:
    """A layer's saved tensors, when they fit its storage: `written` slots of its shape and dtypes."""
    names = _saved_names(layer.kv_format, isinstance(layer, SinkLayer))
    found = tuple(state.get(f"layers.{number}.{name}") for name in names)
    saved = tuple(tensor for tensor in found if tensor is not None and tensor.dim() == 4)
    slot_count = 4 if layer.kv_format == INT8 else 2  # then the exact sinks, if any
    fits = len(saved) == len(found) and saved[0].shape[2] == written <= layer.slots
    fits = fits and all(tensor.shape[:3] == saved[0].shape[:3] for tensor in saved[:slot_count])
    fits = fits and all(tensor.shape[2] == getattr(layer, "sinks", 0) for tensor in saved[slot_count:])
    if fits and layer.is_initialized:
        stored = layer.slot_tensors() + (layer.sink_tensors()[2:] if isinstance(layer, SinkLayer) else [])
        fits = all(
            each.shape[:2] == own.shape[:2] and each.shape[3] == own.shape[3] and each.dtype == own.dtype
            for each, own in zip(saved, stored, strict=True)
        )
    if not fits:
        keys = found[0]
        shape = tuple(layer.keys.shape) if layer.is_initialized else f"{layer.slots} slots"
        described = tuple(keys.shape) if keys is not None else "missing"
        raise CacheStateError(f"layer {number} was saved as {described} {getattr(keys, 'dtype', '')}, not {shape}")
    return saved


def _checked_pristine(
    number: int, layer: SinkLayer, state: dict[str, torch.Tensor], keys: torch.Tensor
) -> torch.Tensor:
    pristine = state[f"layers.{number}.pristine_sinks"]
    expected = (*keys.shape[:2], layer.sinks, layer.rotary.rotary_dim)
    if tuple(pristine.shape) != expected:
        raise CacheStateError(f"layer {number}'s sinks were saved as {tuple(pristine.shape)}")
    return pristine
