"""SinkCache: the transformers Cache that streams a conversation through sinks + a rolling window.

    cache = SinkCache.for_model(model, sinks=4, window=2000)
    logits, eviction = forward(model, cache, input_ids, label=0)   # streamchat.cache.feeding: forever
    cache.held_tokens()                    # what the model sees now, each token with its label (record.py)

Each forward pass of the model through the cache is opened in one call:

    with cache.forward_pass(input_ids, label) as opened:   # room made (opened.eviction), slots and positions
        model(input_ids=input_ids, cache=cache, position_ids=opened.inputs.position_ids,
              attention_mask=opened.inputs.attention_mask)   # the layers write through `update`

Leaving the block closes the pass; an exception from the model leaves the cache torn
(is_consistent() is False) until it is reset. A one-token pass into a cache whose sinks
are full can instead be taken with device tensors only, so its shapes never change and
it compiles to one graph: `with cache.decode_pass(label) as eviction:` plans it on the
host, and the block runs `decode_inputs(token)` and the model, device work only; the host
names its token when it reads it back (`learn_token`), unless it knew it before the pass.

A pass makes the room it needs. `evict_for_space(n)` makes room ahead, for a caller
that wants more than the next pass needs (the paper's per-turn policy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
from transformers.cache_utils import Cache

from streamchat.cache import masks
from streamchat.cache.architectures import LayerSpec, keeps_own_window, layer_specs
from streamchat.cache.layers import DecodeStorage, SinkLayer, SlidingLayer, build_layers
from streamchat.cache.ledger import (
    NO_LABEL,
    CacheStats,
    Eviction,
    Run,
    SinkPlacement,
    SlidingLedger,
    SlidingPlacement,
    StreamLedger,
    known_sliding,
)
from streamchat.cache.masks import POSITION, SINK_SHIFT, SLIDING_WRITE, WRITE, Occupancy, slot_index
from streamchat.cache.quantized_kv import FULL, KVFormat, Stored, checked_format, kv_format_of, widened
from streamchat.cache.record import UNREAD, HeldTokens, SlotRecord
from streamchat.errors import CacheStateError, UnsupportedModelError

DECODE = "decode"  # what _open_pass holds during a decode pass taken with device tensors


class PassInputs(NamedTuple):
    """What the model runs one pass with, besides the input ids and the cache."""

    position_ids: torch.Tensor  # [1, n]
    attention_mask: torch.Tensor | dict[str, torch.Tensor]  # 4D, or one per layer type


class ForwardPass(NamedTuple):
    """An open forward pass: what the model runs with, and what the cache evicted to make room for it."""

    inputs: PassInputs
    eviction: Eviction | None  # None: nothing had to leave


class SinkCache(Cache):
    """StreamingLLM's cache: `sinks` first tokens forever, the `window` most recent, nothing between."""

    def __init__(
        self,
        specs: Sequence[LayerSpec],
        sinks: int,
        window: int,
        *,
        attention: str = "sdpa",
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        kv_format: KVFormat = FULL,
    ) -> None:
        self.kv_format = checked_format(kv_format)
        self.ledger = StreamLedger(sinks, window)
        windows = {own for spec in specs if (own := spec.sliding_window) is not None and keeps_own_window(spec, window)}
        if len(windows) > 1:
            raise UnsupportedModelError(f"layers use several sliding windows {sorted(windows)}")
        self.sliding = SlidingLedger(windows.pop()) if windows else None
        sliding_slots = self.sliding.slots if self.sliding else 0
        ring_slots, max_shift = self.ledger.ring.slots, self.ledger.max_shift
        layers, self.tables = build_layers(specs, window, sinks, ring_slots, sliding_slots, max_shift, kv_format)
        super().__init__(layers=layers)  # type: ignore[arg-type]  # transformers': list (invariant) of its base types
        self.ring_layers: list[SinkLayer | SlidingLayer] = layers  # `layers` itself, typed as what it holds
        sink_layers = [layer for layer in layers if isinstance(layer, SinkLayer)]
        self._sink_layers = sink_layers if len(sink_layers) == len(layers) else None  # None: a layer slides
        # Which table each layer rotates with, by index (plain ints: fine inside a compiled pass).
        self._table_of = [self.tables.index(layer.rotary) for layer in layers]
        self.layer_types = {spec.layer_type: keeps_own_window(spec, window) for spec in specs}
        self.boolean_masks = attention in masks.BOOLEAN_MASK_ATTENTION
        self.mask_dtype = dtype
        self.device = torch.device(device)
        self.static_extent = False  # decode passes attend over every slot (set for compiled ones)
        self.occupancy = Occupancy(self.ledger.slots, self.sliding.slots if self.sliding else 0, self.device)
        self.record = SlotRecord.empty(self.ledger.slots)  # each sink-layer slot's token and label, on the host
        self._open_pass: SinkPlacement | str | None = None
        self._sliding_placement: SlidingPlacement | None = None
        self._rotation: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # table index -> (cos, sin)
        self._placed_shift: int | None = None  # the shift the sinks sit at, None: unknown
        self._freed: list[Run] = []  # ring slots evicted since the occupancy was last brought up to date

    @classmethod
    def for_model(cls, model: Any, sinks: int, window: int) -> SinkCache:
        """A cache for a loaded transformers model (refused with a clear error if unsupported), in the KV format
        the loader chose for it (quantized_kv.kv_format_of)."""
        return cls(
            layer_specs(model),
            sinks,
            window,
            attention=model.config._attn_implementation,
            dtype=model.dtype,
            device=model.get_input_embeddings().weight.device,
            kv_format=kv_format_of(model),
        )

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
        """Make room ahead: drop the oldest window tokens so that `incoming` more tokens fit; sinks stay.

        A pass makes the room it needs itself and returns what that evicted. Call this only
        to make more room than the next pass needs: the paper's per-turn policy makes room
        for a prompt and its reply at once (TokenLoop.prefill's `reply_room`).
        """
        count = self.ledger.overflow(incoming)
        freed = self.ledger.ring.runs(self.ledger.ring.head, count)
        self._freed.extend(freed)
        eviction = self.ledger.evict(count)
        if eviction is None:
            return None
        # Read before any pass reuses the slots: the tokens that left, for whoever shows or recalls them.
        token_ids, labels = self.record.read(self._physical(freed))
        self.ledger.last_forgotten_label = labels[-1]
        return dataclasses.replace(eviction, token_ids=tuple(token_ids))

    def count_skipped(self, count: int, label: int) -> None:
        """`count` tokens labelled `label` were passed over unfed (a long prompt's middle): forgotten all the same."""
        self.ledger.skip(count, label)

    def held_tokens(self) -> HeldTokens:
        """What the model sees now, in stream order, each token with its label; and what it forgot."""
        return self.record.held(self.ledger)

    def restore_held(self, held: HeldTokens) -> None:
        """After a saved snapshot was restored (snapshots.py): the held slots' tokens and labels, and what was
        forgotten, as held_tokens() gave them when the state was saved. CacheStateError when they do not fit
        the ledger."""
        self.record.put_held(self.ledger, held)

    def learn_token(self, token_id: int) -> None:
        """The id of the newest token, read back on the host after a decode pass fed it from the device."""
        self.record.token_ids[self.ledger.newest_slot] = token_id

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The rotary position of the next token."""
        return self.ledger.next_position

    def is_consistent(self) -> bool:
        """False when a forward pass stopped half way (some layers missed it): reset, then refill."""
        return self._open_pass is None

    @contextmanager
    def forward_pass(self, input_ids: torch.Tensor, label: int = NO_LABEL) -> Iterator[ForwardPass]:
        """One forward pass of input_ids [1, n], each token recorded with `label`: the model runs inside the
        block, under inference mode.

        Entering makes room, assigns the tokens' slots and positions and yields the position
        ids and masks the model runs with, and the eviction that made the room. Leaving
        closes the pass. An exception from the block leaves the cache torn: some layers may
        have written and others not, so is_consistent() is False until reset().
        """
        with torch.inference_mode():
            eviction = self._open(input_ids.shape[-1])
            yield ForwardPass(self._frame(input_ids, label), eviction)
            self._close()

    @contextmanager
    def decode_pass(self, label: int = NO_LABEL, token_id: int = UNREAD) -> Iterator[Eviction | None]:
        """One token's forward pass with device tensors only, once the sinks are full; yields its eviction.

        Entering plans the pass on the host and hands its slots and angles to the device (no
        sync). The block then runs `decode_inputs(token)` and the model, device work only, the
        same every pass (compilable), under inference mode. Leaving closes the pass; an
        exception from the block leaves the cache torn, as in forward_pass(). The token is recorded
        with `label`, and with `token_id` when the host knows it already (else learn_token()).
        """
        if not self.ledger.sinks_full:
            raise CacheStateError("a decode pass needs the sinks filled first; feed through cache.forward_pass")
        with torch.inference_mode():
            eviction = self._open(1)
            self._plan_decode(label, token_id)
            yield eviction
            self._close()

    def decode_inputs(self, token: torch.Tensor) -> PassInputs:
        """The device half of a decode pass for token [1, 1]: tensor operations only, the same every pass."""
        occupancy = self.occupancy
        occupancy.take_token(token)
        self._rotation = self._sink_rotation(occupancy.scalars[SINK_SHIFT])
        sliding = occupancy.sliding_held[: self._decode_extent(sliding=True)] if self.sliding is not None else None
        full = occupancy.held[: self._decode_extent(sliding=False)]
        position_ids = occupancy.slot(POSITION).reshape(1, 1)
        return PassInputs(position_ids, self._masks(full, sliding))

    def decode_storage(self) -> DecodeStorage | None:
        """The open decode pass's storage as one row, for a kernel that writes every layer itself; None outside
        a decode pass, or where a layer slides or layers rotate by more than one table."""
        layers = self._sink_layers
        if self._open_pass != DECODE or len(self._rotation) != 1 or layers is None:
            return None
        ((cos, sin),) = self._rotation.values()
        return DecodeStorage.of(
            [layer.slot_tensors() for layer in layers],
            [layer.sink_tensors() for layer in layers],
            self.kv_format,
            self.occupancy.slot(WRITE),
            torch.tensor([self.sinks]),
            self._decode_extent(sliding=False),
            cos[None],
            sin[None],
        )

    def mark_static(self) -> None:
        """Give the storage fixed addresses for CUDA graphs, which a compiled decode pass writes into."""
        for tensor in self.occupancy.tensors():
            torch._dynamo.mark_static_address(tensor)
        for layer in self.ring_layers:
            for tensor in layer.stored_tensors() if layer.is_initialized else []:
                torch._dynamo.mark_static_address(tensor)

    # ---- the transformers Cache interface ---------------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return widened(self.store(key_states, value_states, layer_idx))

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> Stored:
        """update() for attention that reads an int8 window as it is stored (placement/attention.py): the keys
        and values attention reads, or, in an int8 cache, their QuantizedWindow."""
        layer = self.ring_layers[layer_idx]
        opened = self._open_pass
        if opened == DECODE:
            if isinstance(layer, SlidingLayer):
                write = self.occupancy.slot(SLIDING_WRITE)
                return layer.decode(write, key_states, value_states, self._decode_extent(sliding=True))
            rotation = self._rotation[self._table_of[layer_idx]]
            extent = self._decode_extent(sliding=False)
            return layer.decode(self.occupancy.slot(WRITE), key_states, value_states, rotation, extent)
        if not isinstance(opened, SinkPlacement):  # None: no pass open
            raise CacheStateError("the sink cache was updated outside a pass: call the model through cache.feeding")
        if opened.incoming != key_states.shape[-2]:
            raise CacheStateError(f"layer {layer_idx} got {key_states.shape[-2]} tokens in a pass of {opened.incoming}")
        if isinstance(layer, SlidingLayer):
            if self._sliding_placement is None:
                raise CacheStateError(f"sliding layer {layer_idx} was updated in a pass without a sliding ledger")
            return layer.apply(self._sliding_placement, key_states, value_states)
        return layer.apply(opened, key_states, value_states, self._rotation.get(self._table_of[layer_idx]))

    def get_query_offset(self, layer_idx: int = 0) -> int:
        raise CacheStateError("the sink cache hands the model its masks: call the model through cache.feeding")

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        raise CacheStateError("the sink cache hands the model its masks: call the model through cache.feeding")

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.ledger.capacity

    @torch.inference_mode()
    def reset(self) -> None:
        """Forget everything: an empty cache, positions from 0 (the storage stays allocated)."""
        self.ledger = StreamLedger(self.ledger.sinks, self.ledger.window)
        if self.sliding is not None:
            self.sliding = SlidingLedger(self.sliding.sliding_window)
        self.record = SlotRecord.empty(self.ledger.slots)
        self.settle()

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("a sink cache cannot be cropped: evicted tokens are gone")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("a sink cache serves one conversation; beam search is not supported")

    # ---- for snapshots (snapshots.py) ---------------------------------------------------

    def settle(self) -> None:
        """After the ledgers were replaced: no pass open, the sinks to be placed again, the occupancy redone."""
        self._open_pass = self._sliding_placement = None
        self._placed_shift = None
        self._sync_occupancy()

    @torch.inference_mode()
    def rebase(self) -> None:
        """Move every position back so the sinks need no shift (one rotation of every stored key)."""
        delta = self.ledger.rebase()
        for layer in self.ring_layers:
            layer.rebase(delta)
        self._placed_shift = None

    # ---- internals ----------------------------------------------------------------------

    def _open(self, incoming: int) -> Eviction | None:
        """Open a pass of `incoming` tokens: room first, then a rebase if one is due; return the eviction."""
        if not self.is_consistent():
            raise CacheStateError("a forward pass stopped half way (some layers missed it): reset the cache")
        eviction = self.evict_for_space(incoming)
        if self.ledger.rebase_due:
            self.rebase()
        return eviction

    def _frame(self, input_ids: torch.Tensor, label: int) -> PassInputs:
        """Assign slots and positions to input_ids [1, n] (room made), record them, build the pass's inputs."""
        incoming = input_ids.shape[-1]
        placement = self.ledger.place(incoming)
        sliding = self.sliding.place(incoming) if self.sliding is not None else None
        self._open_pass, self._sliding_placement = placement, sliding
        runs = [placement.sink_slots, *self._physical(placement.window_runs)]
        new_slots = slot_index(runs, self.device)
        self.record.write(runs, input_ids[0].tolist(), [label] * incoming)
        self._sync_occupancy()
        self.occupancy.record(new_slots, input_ids[0])
        self._rotation = self._sink_rotation() if self._placed_shift != placement.sink_shift else {}
        window = self.sliding.sliding_window if self.sliding is not None else 0
        full, sliding_mask = self.occupancy.pass_masks(placement, sliding, new_slots, window)
        positions = torch.arange(placement.first_position, placement.first_position + incoming, device=self.device)
        return PassInputs(positions[None], self._masks(full, sliding_mask))

    def _plan_decode(self, label: int, token_id: int) -> None:
        """Plan a one-token pass (room made) on the host, record it, send its slots and angles to the device."""
        if sum(stop - start for start, stop in self._freed) > 1:
            self._sync_occupancy()  # more than one token left since the last pass: catch up here, eagerly
        freed = self.sinks + self._freed[0][0] if self._freed else None
        placement = self.ledger.place(1)
        write = self.sinks + placement.window_runs[0][0]
        self.record.write([(write, write + 1)], [token_id], [label])
        sliding = self.sliding.place(1) if self.sliding is not None else None
        self._freed = []
        self.occupancy.send_decode(placement.first_position, placement.sink_shift, write, freed, sliding)
        self._open_pass = DECODE

    def _close(self) -> None:
        """Close the pass once every layer has written."""
        if self._open_pass == DECODE:
            self._placed_shift = None  # a decode pass places the sinks itself, at a shift only the device saw
        elif isinstance(self._open_pass, SinkPlacement) and self._rotation:
            self._placed_shift = self._open_pass.sink_shift
        self._open_pass = self._sliding_placement = None

    def _physical(self, ring_runs: Sequence[Run]) -> list[Run]:
        """Runs of ring slots as physical slots of the sink layers (the sinks come first)."""
        return [(self.sinks + start, self.sinks + stop) for start, stop in ring_runs]

    def _sync_occupancy(self) -> None:
        self.occupancy.sync(self.ledger, self.sliding)
        self._freed = []

    def _sink_rotation(self, shift: torch.Tensor | None = None) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin of the pass's sink shift, once per rotary geometry, for every sink layer."""
        if shift is None:
            if not self.ledger.sinks_full:
                return {}
            shift = torch.tensor([self.ledger.sink_shift], device=self.device)
        used = {self._table_of[index] for index, layer in enumerate(self.ring_layers) if isinstance(layer, SinkLayer)}
        return {index: self.tables[index].cos_sin(shift) for index in sorted(used)}

    def _masks(self, full: torch.Tensor, sliding: torch.Tensor | None) -> torch.Tensor | dict[str, torch.Tensor]:
        return masks.for_layers(full, sliding, self.layer_types, self.boolean_masks, self.mask_dtype)

    def _decode_extent(self, sliding: bool) -> int:
        if sliding:
            ledger = known_sliding(self.sliding)
            return ledger.slots if self.static_extent else ledger.ring.extent
        return self.ledger.slots if self.static_extent else self.sinks + self.ledger.ring.extent
