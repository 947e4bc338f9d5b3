"""Per-layer storage of the sink cache, as transformers cache layers.

Each layer allocates its whole capacity once, on its first update, and then only
writes into it. The ledgers (ledger.py) decide every slot; layers carry out their
steps, so all layers stay in lockstep.
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch
from transformers.cache_utils import CacheLayerMixin

from streamchat.cache.ledger import Run, SinkStep, SlidingStep
from streamchat.cache.rope import RotaryTable


class _RingLayer(CacheLayerMixin):
    """Storage shared by both layer kinds: keys and values [batch, kv_heads, slots, head_dim]."""

    # What snapshot() saves and restore() puts back.
    _state = ("keys", "values", "is_initialized", "steps")

    def __init__(self, slots: int, rotary: RotaryTable) -> None:
        super().__init__()
        self.slots = slots
        self.rotary = rotary
        self.steps = 0  # forward passes written, checked against the cache's count

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        batch, heads, _, key_dim = key_states.shape
        self.keys = key_states.new_zeros(batch, heads, self.slots, key_dim)
        self.values = value_states.new_zeros(batch, heads, self.slots, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def update(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError("sink cache layers are written through SinkCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise NotImplementedError("mask sizes come from SinkCache.get_mask_sizes")

    def get_seq_length(self) -> int:
        raise NotImplementedError("positions come from SinkCache.get_seq_length")

    def get_max_length(self) -> int:
        return self.slots

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.steps = 0

    def snapshot(self) -> dict[str, Any]:
        # Kept in host memory: a copy on the accelerator would double the cache's footprint there.
        return {name: _copied(getattr(self, name), "cpu") for name in self._state}

    def restore(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, _copied(value, self.device))

    def _write_runs(self, base: int, runs: tuple[Run, ...], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Copy keys/values [batch, heads, n, dim], in order, into the slot runs (offset by `base`)."""
        taken = 0
        for start, stop in runs:
            count = stop - start
            self.keys[:, :, base + start : base + stop] = keys[:, :, taken : taken + count]
            self.values[:, :, base + start : base + stop] = values[:, :, taken : taken + count]
            taken += count

    def _roll(self, start: int, stop: int, by: int) -> None:
        """Roll slots [start, stop) left by `by`, so the oldest token lands at `start`."""
        for states in (self.keys, self.values):
            region = states[:, :, start:stop]
            region.copy_(region.roll(-by, dims=2))

    def _rotate_slots(self, start: int, stop: int, shift: int) -> None:
        """Move the keys in slots [start, stop) by `shift` positions (one rounding)."""
        rotary = self.keys[:, :, start:stop, : self.rotary.rotary_dim]
        rotary.copy_(self.rotary.rotate(rotary, shift))


class SinkLayer(_RingLayer):
    """A full-attention layer: `sinks` slots kept forever, then a ring of `window` slots.

    The sink keys are kept twice: as received (pristine, float32) and rotated by the
    current sink shift into the storage, always from the pristine copy, so they are
    rounded at most twice however long the stream runs.
    """

    is_sliding = False
    _state = (*_RingLayer._state, "pristine_sinks", "sink_partners", "sink_shift", "sinks_written")

    def __init__(self, sinks: int, window: int, rotary: RotaryTable) -> None:
        super().__init__(sinks + window, rotary)
        self.sinks = sinks
        self.window = window
        self.pristine_sinks: torch.Tensor | None = None
        self.sink_partners: torch.Tensor | None = None
        self.sink_shift = 0
        self.sinks_written = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        batch, heads = key_states.shape[:2]
        shape = (batch, heads, self.sinks, self.rotary.rotary_dim)
        self.pristine_sinks = torch.zeros(shape, dtype=torch.float32, device=self.device)
        self.sink_partners = torch.zeros(shape, dtype=torch.float32, device=self.device)

    def apply(
        self, step: SinkStep, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        first, last = step.sink_slots
        to_sinks = last - first
        if to_sinks:
            self._write_runs(0, (step.sink_slots,), key_states, value_states)
            pristine = key_states[:, :, :to_sinks, : self.rotary.rotary_dim].float()
            self.pristine_sinks[:, :, first:last] = pristine
            self.sink_partners[:, :, first:last] = self.rotary.partner(pristine)
            self.sinks_written = last
        self._write_runs(self.sinks, step.window_runs, key_states[:, :, to_sinks:], value_states[:, :, to_sinks:])
        if step.roll:
            self._roll(self.sinks, self.slots, step.roll)
        self.place_sinks(step.sink_shift)
        return self.keys[:, :, : step.used], self.values[:, :, : step.used]

    def place_sinks(self, shift: int) -> None:
        """Rotate the sinks from their pristine copy so they sit `shift` positions later."""
        if shift == self.sink_shift or not self.sinks_written:
            return
        cos, sin = self.rotary.cos_sin(shift, self.device)
        held = self.sinks_written
        rotated = torch.addcmul(self.pristine_sinks[:, :, :held] * cos, self.sink_partners[:, :, :held], sin)
        self.keys[:, :, :held, : self.rotary.rotary_dim] = rotated
        self.sink_shift = shift

    def rebase(self, delta: int) -> None:
        """Positions move back by `delta`: rotate the window once; the sinks follow from pristine."""
        if self.is_initialized:
            self._rotate_slots(self.sinks, self.slots, -delta)
            self.place_sinks(0)

    def reset(self) -> None:
        super().reset()
        self.pristine_sinks = self.sink_partners = None
        self.sink_shift = 0
        self.sinks_written = 0


class SlidingLayer(_RingLayer):
    """A layer with the model's own sliding window: no sinks, each query sees the last tokens only."""

    is_sliding = True

    def apply(
        self, step: SlidingStep, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if step.incoming == 1:
            # A single query sees every slot, so slot order does not matter.
            self._write_runs(0, step.runs, key_states, value_states)
            return self.keys[:, :, : step.used], self.values[:, :, : step.used]
        # Several queries: the causal sliding mask needs the old tokens in age order, then the new.
        if step.roll:
            self._roll(0, self.slots, step.roll)
        start, stop = step.kept_slots
        # [batch, heads, kept + incoming, dim]: the kept tokens, oldest first, then the new ones.
        keys = torch.cat((self.keys[:, :, start:stop], key_states), dim=2)
        values = torch.cat((self.values[:, :, start:stop], value_states), dim=2)
        tail = slice(step.incoming - step.stored, step.incoming)
        self._write_runs(0, step.runs, key_states[:, :, tail], value_states[:, :, tail])
        return keys, values

    def rebase(self, delta: int) -> None:
        if self.is_initialized:
            self._rotate_slots(0, self.slots, -delta)


def _copied(value: Any, device: torch.device | str) -> Any:
    return value.to(device, copy=True) if isinstance(value, torch.Tensor) else value
