"""The sink cache's layers: the storage of each attention layer (architectures.py: LayerSpec says what it is).

Each layer allocates its whole capacity once, on its first update, and then only
writes into it; slots never move. The ledgers (ledger.py) decide every slot; layers
carry out their placements, so all layers stay in lockstep. A pass comes in one of two
forms: a plan in Python ints (any number of tokens, eager), or a decode pass whose
slot and rotation are device tensors (one token, fixed shapes: compilable). Keys and
values are stored in the model's dtype, or (--kv-cache int8) as int8 levels and scales,
quantized as they are written, the sinks apart and exact (quantized_kv.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

import torch
from transformers.cache_utils import CacheLayerMixin

from streamchat.cache.architectures import LayerSpec, keeps_own_window
from streamchat.cache.ledger import Run, SinkPlacement, SlidingPlacement
from streamchat.cache.quantized_kv import FULL, INT8, KVFormat, QuantizedWindow, Stored, dequantize, quantize, widened
from streamchat.cache.rope import RotaryTable


def build_layers(
    specs: Sequence[LayerSpec],
    window: int,
    sinks: int,
    ring_slots: int,
    sliding_slots: int,
    max_shift: int,
    kv_format: KVFormat = FULL,
) -> tuple[list[SinkLayer | SlidingLayer], list[RotaryTable]]:
    """A layer for each spec in a cache of `window` recent tokens, storing keys and values in `kv_format`, and
    the rotary tables they share: one per geometry, up to `max_shift`."""
    tables: list[RotaryTable] = []
    layers: list[SinkLayer | SlidingLayer] = []
    for spec in specs:
        table = next((table for table in tables if table.same_geometry(spec.inv_freq, spec.layout)), None)
        if table is None:
            table = RotaryTable(spec.inv_freq, spec.layout, max_shift)
            tables.append(table)
        own = keeps_own_window(spec, window)
        layers.append(
            SlidingLayer(sliding_slots, table, kv_format) if own else SinkLayer(sinks, ring_slots, table, kv_format)
        )
    return layers, tables


class DecodeStorage(NamedTuple):
    """An open decode pass laid out for a kernel that carries it out itself (placement/lean_forward.py): the
    rows of one SinkCache (one row) or of a pool (batch.py), each at its own slot and sink shift."""

    slots: torch.Tensor  # int64 [rows]: where each row's key and value go
    sinks: torch.Tensor  # int64 [rows]: how many sinks each row has
    extent: int  # the slots attention reads, from the first
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, slots, head_dim] (int8 levels in an int8 cache)
    values: list[torch.Tensor]
    pristine: list[torch.Tensor]  # per layer float32 [rows, kv_heads, sinks, rotary_dim]; partners likewise
    partners: list[torch.Tensor]
    sink_cos: torch.Tensor  # float32 [rows, rotary_dim]: each row's sink rotation (every layer has one table)
    sink_sin: torch.Tensor
    kv_format: KVFormat = FULL
    # An int8 cache's, per layer: float32 scales [rows, kv_heads, slots, 1], exact sinks [rows, kv_heads, sinks, dim].
    key_scales: list[torch.Tensor] | None = None
    value_scales: list[torch.Tensor] | None = None
    sink_keys: list[torch.Tensor] | None = None
    sink_values: list[torch.Tensor] | None = None

    @classmethod
    def of(
        cls,
        slot_tensors: Sequence[Sequence[torch.Tensor]],
        sink_tensors: Sequence[Sequence[torch.Tensor]],
        kv_format: KVFormat,
        slots: torch.Tensor,
        sinks: torch.Tensor,
        extent: int,
        sink_cos: torch.Tensor,
        sink_sin: torch.Tensor,
    ) -> DecodeStorage:
        """From each layer's slot tensors and sink tensors, in the layers' orders (slot_tensors, sink_tensors)."""
        keys, values, *scales = zip(*slot_tensors, strict=True)
        pristine, partners, *exact = zip(*sink_tensors, strict=True)
        int8 = [list(each) for each in (*scales, *exact)] if kv_format == INT8 else []
        return cls(
            slots, sinks, extent, list(keys), list(values), list(pristine), list(partners), sink_cos, sink_sin,
            kv_format, *int8,
        )  # fmt: skip


class _RingLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__: unannotated
    """Storage shared by both layer kinds: keys and values [batch, kv_heads, slots, head_dim], in the model's
    dtype (full) or as int8 levels with float32 scales [batch, kv_heads, slots, 1] (int8, quantized_kv.py)."""

    keys: torch.Tensor  # allocated on the first update (lazy_initialization), read only after it (None before)
    values: torch.Tensor
    key_scales: torch.Tensor  # an int8 layer's, once initialized
    value_scales: torch.Tensor

    def __init__(self, slots: int, rotary: RotaryTable, kv_format: KVFormat = FULL) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers' CacheLayerMixin.__init__: unannotated
        self.slots = slots
        self.rotary = rotary
        self.kv_format = kv_format

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        stored = torch.int8 if self.kv_format == INT8 else key_states.dtype
        self.keys = key_states.new_zeros(batch, heads, self.slots, key_dim, dtype=stored)
        self.values = value_states.new_zeros(batch, heads, self.slots, value_states.shape[-1], dtype=stored)
        if self.kv_format == INT8:
            self.key_scales = key_states.new_zeros(batch, heads, self.slots, 1, dtype=torch.float32)
            self.value_scales = key_states.new_zeros(batch, heads, self.slots, 1, dtype=torch.float32)
        self.dtype = key_states.dtype  # what attention reads them in
        self.device = key_states.device
        self.is_initialized = True
        # The compiled decode pass writes into these in place: CUDA graphs must see fixed addresses.
        if not torch.compiler.is_compiling():
            for tensor in self.slot_tensors():
                torch._dynamo.mark_static_address(tensor)

    def initialize_like(self, saved: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
        """Allocate as for the slot tensors `saved` (read_slots' first ones); an int8 layer reads in `dtype`."""
        keys, values = saved[0], saved[1]
        dtype = dtype if self.kv_format == INT8 else keys.dtype
        self.lazy_initialization(keys[:, :, :1].to(dtype), values[:, :, :1].to(dtype))

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a row per slot (dim 2), in one order: keys, values, then an int8 layer's scales."""
        if self.kv_format == INT8:
            return [self.keys, self.values, self.key_scales, self.value_scales]
        return [self.keys, self.values]

    def bind_slot_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        """Store into `tensors` (slot_tensors' order) from now on: a pool's views (batch.py), or copies."""
        self.keys, self.values = tensors[0], tensors[1]
        if self.kv_format == INT8:
            self.key_scales, self.value_scales = tensors[2], tensors[3]

    def stored_tensors(self) -> list[torch.Tensor]:
        """Every tensor the layer stores into (a compiled pass's fixed addresses)."""
        return self.slot_tensors()

    def encoded(self, keys: torch.Tensor, values: torch.Tensor) -> list[torch.Tensor]:
        """Keys and values [batch, heads, n, dim] as slot_tensors stores them, in its order."""
        if self.kv_format != INT8:
            return [keys, values]
        (key_levels, key_scales), (value_levels, value_scales) = quantize(keys), quantize(values)
        return [key_levels, value_levels, key_scales, value_scales]

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("sink cache layers are written through SinkCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the sink cache hands its masks to the model (SinkCache.forward_pass)")

    def get_seq_length(self) -> int:
        raise NotImplementedError("positions come from SinkCache.forward_pass")

    def get_max_length(self) -> int:
        return self.slots

    def reset(self) -> None:
        # The storage stays: slots are found through the cache's masks, never by their content.
        pass

    def write_runs(self, base: int, runs: tuple[Run, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy keys/values [batch, heads, n, dim], in order, into the slot runs (offset by `base`)."""
        encoded = self.encoded(keys, values)
        taken = 0
        for start, stop in runs:
            count = stop - start
            for stored, new in zip(self.slot_tensors(), encoded, strict=True):
                stored[:, :, base + start : base + stop] = new[:, :, taken : taken + count]
            taken += count

    def write_slot(self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one token [batch, heads, 1, dim] at `slot`, a one-element index tensor."""
        for stored, new in zip(self.slot_tensors(), self.encoded(key_states, value_states), strict=True):
            stored.index_copy_(2, slot, new)

    def rotate_slots(self, start: int, stop: int, shift: int) -> None:
        """Move the keys in slots [start, stop) by `shift` positions (one rounding; int8: one requantization)."""
        if self.kv_format != INT8:
            rotary = self.keys[:, :, start:stop, : self.rotary.rotary_dim]
            rotary.copy_(self.rotary.rotate(rotary, shift))
            return
        keys = dequantize(self.keys[:, :, start:stop], self.key_scales[:, :, start:stop], torch.float32)
        keys[..., : self.rotary.rotary_dim] = self.rotary.rotate(keys[..., : self.rotary.rotary_dim], shift)
        self.keys[:, :, start:stop], self.key_scales[:, :, start:stop] = quantize(keys)

    def read_slots(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of the slot tensors in the slots `index` [n] (slot_tensors' order), then any kept apart."""
        return tuple(tensor.index_select(2, index) for tensor in self.slot_tensors())

    def write_back(self, index: torch.Tensor, saved: Sequence[torch.Tensor]) -> None:
        """What read_slots gave, into the same slots."""
        slot_tensors = self.slot_tensors()
        for stored, kept in zip(slot_tensors, saved[: len(slot_tensors)], strict=True):
            stored.index_copy_(2, index, kept)

    def stored(self, start: int, stop: int) -> Stored:
        """What attention reads of slots [start, stop): the keys and values, or their int8 window."""
        if self.kv_format != INT8:
            return self.keys[:, :, start:stop], self.values[:, :, start:stop]
        empty = self.keys.new_zeros(*self.keys.shape[:2], 0, self.keys.shape[3], dtype=self.dtype)
        return self._window(start, stop, empty, empty, torch.zeros(self.keys.shape[0], dtype=torch.long))

    def _window(
        self, start: int, stop: int, sink_keys: torch.Tensor, sink_values: torch.Tensor, sinks: torch.Tensor
    ) -> QuantizedWindow:
        span = slice(start, stop)
        return QuantizedWindow(
            self.keys[:, :, span], self.values[:, :, span], self.key_scales[:, :, span],
            self.value_scales[:, :, span], sink_keys, sink_values, sinks.to(self.device),
        )  # fmt: skip


class SinkLayer(_RingLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__: unannotated
    """A full-attention layer: `sinks` slots kept forever, then a ring of `window + 1` slots.

    The sink keys are kept twice: as received (pristine, float32) and rotated by the
    current sink shift into the storage, always from the pristine copy, so they are
    rounded at most twice however long the stream runs. In an int8 cache the sinks'
    keys and values are stored apart, in the model's dtype (sink_keys, sink_values):
    exact, as in a full cache; the int8 storage's first `sinks` slots stay unused.
    """

    is_sliding = False
    pristine_sinks: torch.Tensor  # once initialized
    sink_partners: torch.Tensor
    sink_keys: torch.Tensor  # an int8 layer's, once initialized
    sink_values: torch.Tensor

    def __init__(self, sinks: int, ring_slots: int, rotary: RotaryTable, kv_format: KVFormat = FULL) -> None:
        super().__init__(sinks + ring_slots, rotary, kv_format)
        self.sinks = sinks

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        shape = (batch, heads, self.sinks, self.rotary.rotary_dim)
        self.pristine_sinks = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.sink_partners = torch.zeros(shape, dtype=torch.float32, device=self.device)
        if self.kv_format == INT8:
            self.sink_keys = key_states.new_zeros(batch, heads, self.sinks, key_states.shape[3])
            self.sink_values = value_states.new_zeros(batch, heads, self.sinks, value_states.shape[3])
        self.row_sinks = torch.full((batch,), self.sinks, dtype=torch.long)

    def sink_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a row per sink: pristine, partners, then an int8 layer's exact sinks."""
        if self.kv_format == INT8:
            return [self.pristine_sinks, self.sink_partners, self.sink_keys, self.sink_values]
        return [self.pristine_sinks, self.sink_partners]

    def bind_sink_tensors(self, tensors: Sequence[torch.Tensor]) -> None:
        self.pristine_sinks, self.sink_partners = tensors[0], tensors[1]
        if self.kv_format == INT8:
            self.sink_keys, self.sink_values = tensors[2], tensors[3]

    def stored_tensors(self) -> list[torch.Tensor]:
        return self.slot_tensors() + self.sink_tensors()

    def exact_sinks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the sinks' keys and values sit in the model's dtype [batch, heads, sinks, dim]."""
        if self.kv_format == INT8:
            return self.sink_keys, self.sink_values
        return self.keys[:, :, : self.sinks], self.values[:, :, : self.sinks]

    def read_slots(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        exact = (self.sink_keys.clone(), self.sink_values.clone()) if self.kv_format == INT8 else ()
        return super().read_slots(index) + exact

    def write_back(self, index: torch.Tensor, saved: Sequence[torch.Tensor]) -> None:
        super().write_back(index, saved)
        if self.kv_format == INT8:
            self.sink_keys.copy_(saved[-2])
            self.sink_values.copy_(saved[-1])

    def stored(self, start: int, stop: int) -> Stored:
        if self.kv_format != INT8:
            return super().stored(start, stop)
        return self._window(start, stop, self.sink_keys, self.sink_values, self.row_sinks)

    def apply(
        self,
        placement: SinkPlacement,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> Stored:
        """Carry out an eager pass; `rotation` (cos, sin) places the sinks, None leaves them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first, last = placement.sink_slots
        to_sinks = last - first
        if to_sinks:
            sink_keys, sink_values = self.exact_sinks()
            sink_keys[:, :, first:last] = key_states[:, :, :to_sinks]
            sink_values[:, :, first:last] = value_states[:, :, :to_sinks]
            pristine = key_states[:, :, :to_sinks, : self.rotary.rotary_dim].float()
            self.pristine_sinks[:, :, first:last] = pristine
            self.sink_partners[:, :, first:last] = self.rotary.partner(pristine)
        self.write_runs(self.sinks, placement.window_runs, key_states[:, :, to_sinks:], value_states[:, :, to_sinks:])
        if rotation is not None:
            self.place_sinks(*rotation)
        stored = self.stored(0, placement.extent)
        if not isinstance(stored, QuantizedWindow):
            return stored
        # The pass's queries see its own tokens as they were computed, as in a full cache (a prompt's first reply
        # token is then the full cache's after an exact system turn); what was cached before, as it is stored.
        keys, values = stored.widened()
        taken = to_sinks
        for start, stop in placement.window_runs:
            span, fed = slice(self.sinks + start, self.sinks + stop), slice(taken, taken + stop - start)
            keys[:, :, span], values[:, :, span] = key_states[:, :, fed], value_states[:, :, fed]
            taken += stop - start
        return keys, values

    def decode(
        self,
        slot: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor],
        extent: int,
    ) -> Stored:
        """One token into a cache whose sinks are full: the same operations whatever the slot or shift."""
        self.write_slot(slot, key_states, value_states)
        self.place_sinks(*rotation)
        return self.stored(0, extent)

    def place_sinks(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the sinks from their pristine copy by the angles cos, sin [rotary_dim]."""
        rotated = torch.addcmul(self.pristine_sinks * cos, self.sink_partners, sin)
        self.exact_sinks()[0][..., : self.rotary.rotary_dim] = rotated

    def rebase(self, delta: int) -> None:
        """Positions move back by `delta`: rotate the window once (the sinks follow from pristine)."""
        if self.is_initialized:
            self.rotate_slots(self.sinks, self.slots, -delta)


class SlidingLayer(_RingLayer):  # type: ignore[no-untyped-call]  # transformers' __init_subclass__: unannotated
    """A layer with the model's own sliding window: no sinks, each query sees the last tokens only."""

    is_sliding = True

    def apply(self, placement: SlidingPlacement, key_states: torch.Tensor, value_states: torch.Tensor) -> Stored:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tail = slice(placement.stored_from, placement.incoming)
        if placement.incoming == 1:
            # A single query: the ring itself, its mask says which slots it sees.
            self.write_runs(0, placement.runs, key_states, value_states)
            return self.stored(0, placement.extent)
        # Several queries: the tokens they still see, oldest first, then the new ones (the mask is
        # a banded causal one over this order). Gathered before the new tokens overwrite slots.
        kept = [widened(self.stored(start, stop)) for start, stop in placement.kept]
        keys = torch.cat([pair[0] for pair in kept] + [key_states], dim=2)
        values = torch.cat([pair[1] for pair in kept] + [value_states], dim=2)
        self.write_runs(0, placement.runs, key_states[:, :, tail], value_states[:, :, tail])
        return keys, values

    def decode(self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, extent: int) -> Stored:
        self.write_slot(slot, key_states, value_states)
        return self.stored(0, extent)

    def rebase(self, delta: int) -> None:
        if self.is_initialized:
            self.rotate_slots(0, self.slots, -delta)
