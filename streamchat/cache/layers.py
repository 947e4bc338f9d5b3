"""The sink cache's layers: what each attention layer is (LayerSpec, read from a model) and its storage.

A LayerSpec is a layer's rotary frequencies and the model's own sliding window if it has one.

Each layer allocates its whole capacity once, on its first update, and then only
writes into it; slots never move. The ledgers (ledger.py) decide every slot; layers
carry out their steps, so all layers stay in lockstep. A step comes in one of two
forms: a plan in Python ints (any number of tokens, eager), or a decode step whose
slot and rotation are device tensors (one token, fixed shapes: compilable).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, NoReturn

import torch
from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs

from streamchat.cache.architectures import RotaryLayout, ensure_supported
from streamchat.cache.ledger import Run, SinkStep, SlidingStep
from streamchat.cache.rope import RotaryTable
from streamchat.errors import UnsupportedModelError


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: its rotary frequencies, and the model's own sliding window if it has one."""

    inv_freq: torch.Tensor
    layout: RotaryLayout = "rotate_half"
    sliding_window: int | None = None
    layer_type: str = "full_attention"  # the model's name for the layer's kind (config.layer_types)


def layer_specs(model: Any) -> list[LayerSpec]:
    """Read each attention layer's rotary frequencies and sliding window from a transformers model."""
    config = model.config.get_text_config(decoder=True)
    layout = ensure_supported(config)
    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    rotary = _rotary_module(model)
    specs = []
    for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise UnsupportedModelError(
                f"model type '{config.model_type}' has '{layer_type}' layers, which cannot stream"
            )
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv_freq is None:
            inv_freq = rotary.inv_freq
        specs.append(LayerSpec(inv_freq, layout, kwargs.get("sliding_window"), layer_type))
    return specs


def keeps_own_window(spec: LayerSpec, window: int) -> bool:
    """Whether a layer keeps the model's sliding window in a cache of `window` recent tokens."""
    # A sliding window no wider than ours is kept as trained. A wider one never binds
    # inside our cache, so such a layer streams with sinks like a full-attention layer.
    return spec.sliding_window is not None and spec.sliding_window <= window


def build_layers(
    specs: Sequence[LayerSpec], window: int, sinks: int, ring_slots: int, sliding_slots: int, max_shift: int
) -> tuple[list[SinkLayer | SlidingLayer], list[RotaryTable]]:
    """A layer for each spec in a cache of `window` recent tokens, and the rotary tables they share: one per
    geometry, up to `max_shift`."""
    tables: list[RotaryTable] = []
    layers: list[SinkLayer | SlidingLayer] = []
    for spec in specs:
        table = next((table for table in tables if table.same_geometry(spec.inv_freq, spec.layout)), None)
        if table is None:
            table = RotaryTable(spec.inv_freq, spec.layout, max_shift)
            tables.append(table)
        own = keeps_own_window(spec, window)
        layers.append(SlidingLayer(sliding_slots, table) if own else SinkLayer(sinks, ring_slots, table))
    return layers, tables


def _rotary_module(model: Any) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise UnsupportedModelError(f"model type '{model.config.model_type}' has no rotary embedding module")


class DecodeStorage(NamedTuple):
    """An open decode step laid out for a kernel that carries it out itself (placement/lean_forward.py): the
    rows of one SinkCache (one row) or of a pool (batch.py), each at its own slot and sink shift."""

    slots: torch.Tensor  # int64 [rows]: where each row's key and value go
    sinks: torch.Tensor  # int64 [rows]: how many sinks each row has
    extent: int  # the slots attention reads, from the first
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, slots, head_dim]; values likewise
    values: list[torch.Tensor]
    pristine: list[torch.Tensor]  # per layer float32 [rows, kv_heads, sinks, rotary_dim]; partners likewise
    partners: list[torch.Tensor]
    sink_cos: torch.Tensor  # float32 [rows, rotary_dim]: each row's sink rotation (every layer has one table)
    sink_sin: torch.Tensor


class _RingLayer(CacheLayerMixin):
    """Storage shared by both layer kinds: keys and values [batch, kv_heads, slots, head_dim]."""

    def __init__(self, slots: int, rotary: RotaryTable) -> None:
        super().__init__()
        self.slots = slots
        self.rotary = rotary

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        self.keys = key_states.new_zeros(batch, heads, self.slots, key_dim)
        self.values = value_states.new_zeros(batch, heads, self.slots, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True
        # The compiled decode step writes into these in place: CUDA graphs must see fixed addresses.
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.keys)
            torch._dynamo.mark_static_address(self.values)

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("sink cache layers are written through SinkCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("the sink cache hands its masks to the model (SinkCache.step)")

    def get_seq_length(self) -> int:
        raise NotImplementedError("positions come from SinkCache.step")

    def get_max_length(self) -> int:
        return self.slots

    def reset(self) -> None:
        # The storage stays: slots are found through the cache's masks, never by their content.
        pass

    def write_runs(self, base: int, runs: tuple[Run, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy keys/values [batch, heads, n, dim], in order, into the slot runs (offset by `base`)."""
        taken = 0
        for start, stop in runs:
            count = stop - start
            self.keys[:, :, base + start : base + stop] = keys[:, :, taken : taken + count]
            self.values[:, :, base + start : base + stop] = values[:, :, taken : taken + count]
            taken += count

    def write_slot(self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write one token [batch, heads, 1, dim] at `slot`, a one-element index tensor."""
        self.keys.index_copy_(2, slot, key_states)
        self.values.index_copy_(2, slot, value_states)

    def rotate_slots(self, start: int, stop: int, shift: int) -> None:
        """Move the keys in slots [start, stop) by `shift` positions (one rounding)."""
        rotary = self.keys[:, :, start:stop, : self.rotary.rotary_dim]
        rotary.copy_(self.rotary.rotate(rotary, shift))

    def read_slots(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys and values in the slots `index` [n]."""
        return self.keys.index_select(2, index), self.values.index_select(2, index)

    def write_back(self, index: torch.Tensor, saved: tuple[torch.Tensor, torch.Tensor]) -> None:
        keys, values = saved
        self.keys.index_copy_(2, index, keys)
        self.values.index_copy_(2, index, values)


class SinkLayer(_RingLayer):
    """A full-attention layer: `sinks` slots kept forever, then a ring of `window + 1` slots.

    The sink keys are kept twice: as received (pristine, float32) and rotated by the
    current sink shift into the storage, always from the pristine copy, so they are
    rounded at most twice however long the stream runs.
    """

    is_sliding = False

    def __init__(self, sinks: int, ring_slots: int, rotary: RotaryTable) -> None:
        super().__init__(sinks + ring_slots, rotary)
        self.sinks = sinks
        self.pristine_sinks: torch.Tensor | None = None
        self.sink_partners: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        shape = (batch, heads, self.sinks, self.rotary.rotary_dim)
        self.pristine_sinks = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.sink_partners = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def apply(
        self,
        step: SinkStep,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Carry out an eager step; `rotation` (cos, sin) places the sinks, None leaves them."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first, last = step.sink_slots
        to_sinks = last - first
        if to_sinks:
            self.write_runs(0, (step.sink_slots,), key_states, value_states)
            pristine = key_states[:, :, :to_sinks, : self.rotary.rotary_dim].float()
            self.pristine_sinks[:, :, first:last] = pristine
            self.sink_partners[:, :, first:last] = self.rotary.partner(pristine)
        self.write_runs(self.sinks, step.window_runs, key_states[:, :, to_sinks:], value_states[:, :, to_sinks:])
        if rotation is not None:
            self.place_sinks(*rotation)
        return self.keys[:, :, : step.extent], self.values[:, :, : step.extent]

    def decode(
        self,
        slot: torch.Tensor,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        rotation: tuple[torch.Tensor, torch.Tensor],
        extent: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token into a cache whose sinks are full: the same operations whatever the slot or shift."""
        self.write_slot(slot, key_states, value_states)
        self.place_sinks(*rotation)
        return self.keys[:, :, :extent], self.values[:, :, :extent]

    def place_sinks(self, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate the sinks from their pristine copy by the angles cos, sin [rotary_dim]."""
        rotated = torch.addcmul(self.pristine_sinks * cos, self.sink_partners, sin)
        self.keys[:, :, : self.sinks, : self.rotary.rotary_dim] = rotated

    def rebase(self, delta: int) -> None:
        """Positions move back by `delta`: rotate the window once (the sinks follow from pristine)."""
        if self.is_initialized:
            self.rotate_slots(self.sinks, self.slots, -delta)


class SlidingLayer(_RingLayer):
    """A layer with the model's own sliding window: no sinks, each query sees the last tokens only."""

    is_sliding = True

    def apply(
        self, step: SlidingStep, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tail = slice(step.stored_from, step.incoming)
        if step.incoming == 1:
            # A single query: the ring itself, its mask says which slots it sees.
            self.write_runs(0, step.runs, key_states, value_states)
            return self.keys[:, :, : step.extent], self.values[:, :, : step.extent]
        # Several queries: the tokens they still see, oldest first, then the new ones (the mask is
        # a banded causal one over this order). Gathered before the new tokens overwrite slots.
        keys = torch.cat([self.keys[:, :, start:stop] for start, stop in step.kept] + [key_states], dim=2)
        values = torch.cat([self.values[:, :, start:stop] for start, stop in step.kept] + [value_states], dim=2)
        self.write_runs(0, step.runs, key_states[:, :, tail], value_states[:, :, tail])
        return keys, values

    def decode(
        self, slot: torch.Tensor, key_states: torch.Tensor, value_states: torch.Tensor, extent: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.write_slot(slot, key_states, value_states)
        return self.keys[:, :, :extent], self.values[:, :, :extent]

    def rebase(self, delta: int) -> None:
        if self.is_initialized:
            self.rotate_slots(0, self.slots, -delta)
