"""SinkCache: the transformers Cache that streams a conversation through sinks + a rolling window.

    cache = SinkCache.for_model(model, sinks=4, window=2000)
    logits = model(input_ids, cache=cache).logits   # any number of calls, forever

Per forward pass of n tokens, the first layer's update plans the step for all layers
(evicting what does not fit), and every layer carries the plan out. Positions come
from `get_seq_length()`, which transformers uses by default, or `position_ids(n)`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache, get_layer_types_and_kwargs

from streamchat.cache.architectures import ensure_supported
from streamchat.cache.layers import SinkLayer, SlidingLayer
from streamchat.cache.ledger import CacheStats, Eviction, SinkStep, SlidingLedger, SlidingStep, StreamLedger
from streamchat.cache.rope import RotaryLayout, RotaryTable
from streamchat.errors import CacheStateError, UnsupportedModelError

EvictionObserver = Callable[[Eviction], None]


@dataclass(frozen=True)
class CacheSnapshot:
    ledger: StreamLedger
    sliding: SlidingLedger | None
    steps: int
    layers: list[dict[str, Any]]


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer: its rotary frequencies, and the model's own sliding window if it has one."""

    inv_freq: torch.Tensor
    layout: RotaryLayout = "rotate_half"
    sliding_window: int | None = None


class SinkCache(Cache):
    """StreamingLLM's cache: `sinks` first tokens forever, the `window` most recent, nothing between."""

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        sinks: int,
        window: int,
        observer: EvictionObserver | None = None,
    ) -> None:
        self.ledger = StreamLedger(sinks, window)
        sliding_windows = {spec.sliding_window for spec in specs if self._own_window(spec, window)}
        if len(sliding_windows) > 1:
            raise UnsupportedModelError(f"layers use several sliding windows {sorted(sliding_windows)}")
        self.sliding = SlidingLedger(sliding_windows.pop()) if sliding_windows else None
        tables = self._tables(specs)
        super().__init__(layers=[self._layer(spec, window, tables) for spec in specs])
        self.observer = observer
        self.steps = 0
        self._step: tuple[SinkStep, SlidingStep | None] | None = None

    @classmethod
    def for_model(cls, model: Any, sinks: int, window: int, observer: EvictionObserver | None = None) -> SinkCache:
        """A cache for a loaded transformers model (refused with a clear error if unsupported)."""
        return cls(layer_specs(model), sinks, window, observer)

    # ---- what callers use -------------------------------------------------------------

    @property
    def sinks(self) -> int:
        return self.ledger.sinks

    @property
    def window(self) -> int:
        return self.ledger.window

    @property
    def capacity(self) -> int:
        return self.ledger.capacity

    def stats(self) -> CacheStats:
        return self.ledger.stats()

    def evict_for_space(self, incoming: int) -> Eviction | None:
        """Drop the oldest window tokens so that `incoming` more tokens fit; sinks stay."""
        return self._report(self.ledger.evict(self.ledger.overflow(incoming)))

    def evict(self, count: int) -> Eviction | None:
        """Drop the `count` oldest window tokens now (the paper's per-turn reserve uses this)."""
        return self._report(self.ledger.evict(count))

    def position_ids(self, count: int, device: torch.device | str | None = None) -> torch.Tensor:
        """Positions [1, count] of the next `count` tokens."""
        start = self.get_seq_length()
        return torch.arange(start, start + count, device=device).unsqueeze(0)

    def is_consistent(self) -> bool:
        """False when a forward pass stopped half way (some layers missed it): reset, then refill."""
        return all(layer.steps == self.steps for layer in self.layers)

    def snapshot(self) -> CacheSnapshot:
        """A copy of everything the cache holds, to restore() later (regenerating a reply)."""
        return CacheSnapshot(
            copy.deepcopy(self.ledger),
            copy.deepcopy(self.sliding),
            self.steps,
            [layer.snapshot() for layer in self.layers],
        )

    def restore(self, snapshot: CacheSnapshot) -> None:
        """Return to the state of snapshot(); the snapshot stays valid for another restore."""
        self.ledger, self.sliding = copy.deepcopy(snapshot.ledger), copy.deepcopy(snapshot.sliding)
        self.steps = snapshot.steps
        for layer, state in zip(self.layers, snapshot.layers, strict=True):
            layer.restore(state)

    # ---- the transformers Cache interface ---------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == 0:
            self._begin_step(key_states.shape[-2])
        if self._step is None:
            raise CacheStateError("the sink cache was updated outside a forward pass")
        sink_step, sliding_step = self._step
        layer = self.layers[layer_idx]
        step = sliding_step if isinstance(layer, SlidingLayer) else sink_step
        if step.incoming != key_states.shape[-2]:
            raise CacheStateError(f"layer {layer_idx} got {key_states.shape[-2]} tokens in a step of {step.incoming}")
        stored = layer.apply(step, key_states, value_states)
        layer.steps = self.steps  # only once written: a layer that fails half way counts as missed
        return stored

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The position of the next token; positions are moved back here, between passes, when due."""
        if self.ledger.next_position >= self.ledger.rebase_at:
            delta = self.ledger.rebase()
            for layer in self.layers:
                layer.rebase(delta)
        return self.ledger.next_position

    def get_query_offset(self, layer_idx: int = 0) -> int:
        if self._is_sliding(layer_idx):
            return self.sliding.kept
        return self.ledger.used

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if self._is_sliding(layer_idx):
            return self.sliding.mask_sizes(query_length)
        return self.ledger.mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.ledger.capacity

    def reset(self) -> None:
        """Forget everything: an empty cache, positions from 0."""
        self.ledger = StreamLedger(self.ledger.sinks, self.ledger.window)
        if self.sliding is not None:
            self.sliding = SlidingLedger(self.sliding.sliding_window)
        for layer in self.layers:
            layer.reset()
        self.steps = 0
        self._step = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sink cache cannot be cropped: evicted tokens are gone")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a sink cache serves one conversation; beam search is not supported")

    # ---- internals ----------------------------------------------------------------------

    def _begin_step(self, incoming: int) -> None:
        if not self.is_consistent():
            unfinished = [index for index, layer in enumerate(self.layers) if layer.steps != self.steps]
            raise CacheStateError(
                f"a forward pass stopped half way (layers {unfinished[0]}..{unfinished[-1]} missed it): reset the cache"
            )
        sink_step = self.ledger.step(incoming)
        sliding_step = self.sliding.step(incoming) if self.sliding is not None else None
        self.steps += 1
        self._step = (sink_step, sliding_step)
        self._report(sink_step.eviction)

    def _report(self, eviction: Eviction | None) -> Eviction | None:
        if eviction is not None and self.observer is not None:
            self.observer(eviction)
        return eviction

    def _is_sliding(self, layer_idx: int) -> bool:
        return layer_idx < len(self.layers) and isinstance(self.layers[layer_idx], SlidingLayer)

    @staticmethod
    def _own_window(spec: LayerSpec, window: int) -> bool:
        # A sliding window no wider than ours is kept as trained. A wider one never binds
        # inside our cache, so such a layer streams with sinks like a full-attention layer.
        return spec.sliding_window is not None and spec.sliding_window <= window

    def _tables(self, specs: Sequence[LayerSpec]) -> list[RotaryTable]:
        tables: list[RotaryTable] = []
        for spec in specs:
            if not any(table.same_geometry(spec.inv_freq, spec.layout) for table in tables):
                tables.append(RotaryTable(spec.inv_freq, spec.layout, self.ledger.max_shift))
        return tables

    def _layer(self, spec: LayerSpec, window: int, tables: list[RotaryTable]) -> SinkLayer | SlidingLayer:
        table = next(table for table in tables if table.same_geometry(spec.inv_freq, spec.layout))
        if self._own_window(spec, window):
            return SlidingLayer(spec.sliding_window, table)
        return SinkLayer(self.ledger.sinks, window, table)


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
        specs.append(LayerSpec(inv_freq, layout, kwargs.get("sliding_window")))
    return specs


def _rotary_module(model: Any) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise UnsupportedModelError(f"model type '{model.config.model_type}' has no rotary embedding module")
