"""Several conversations' sink caches in one forward pass: one pooled allocation whose rows they view.

    batch = CacheBatch()
    batch.join(cache)                          # its layers' storage is now a view of a row of the pool
    with batch.decode_pass(tokens, labels, token_ids) as opened:   # one token for every member, in row order
        model(input_ids=opened.input_ids, cache=batch, position_ids=opened.inputs.position_ids,
              attention_mask=opened.inputs.attention_mask)
    batch.leave(cache)                         # its storage is its own again (a copy of its row)

Why a pool rather than gathering the members' caches into a batch each pass: gathering
copies every member's whole cache, every layer, every pass (4 + 2000 slots of the default
model in float32 is about 90 MB a conversation a pass), more than reading the weights.
In a pool, a member's layers *are* views of its row (`keys[row:row + 1, :, :slots]`), so
the batched attention reads the pool as it is, and each row's write lands in its cache.

Every member stays a SinkCache of its own: its ledgers plan its pass (its sinks, window,
positions, sink shift, evictions), its occupancy marks its slots and its record (record.py)
takes its token and label, exactly as a one-row decode pass does; only the device work of
the pass is shared. Whatever reads or writes a member's storage in place (its snapshots)
is unchanged while it is a member. Leaving copies its row out, so a cache outside a batch
owns its tensors and is saved and restored as always. Members sit in rows 0..n-1: one
leaving gives its row to the last member (one row copied), so a pass's rows are always the
pool's first ones. Joining and leaving copy only the slots a cache has written (a turn's
few hundred of the default model's 2,004), not its whole capacity.

Members may differ in sinks (each conversation's kept prefix): the pool's rows are as wide
as the widest member, a narrower member views the first columns of its row, and the
columns past its own are masked. The pool grows a power of two rows at a time (1, 2, 4, 8,
...); a pass runs only its members' rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import Cache

from streamchat.cache import masks
from streamchat.cache.layers import DecodeStorage, SinkLayer, SlidingLayer
from streamchat.cache.ledger import NO_LABEL, Eviction, known_sliding
from streamchat.cache.masks import POSITION, SINK_SHIFT, SLIDING_WRITE, WRITE
from streamchat.cache.quantized_kv import INT8, QuantizedWindow, Stored, widened
from streamchat.cache.record import UNREAD
from streamchat.cache.sink_cache import PassInputs, SinkCache
from streamchat.errors import CacheStateError


@dataclass(frozen=True)
class BatchPass:
    """An open batched decode pass: what the model runs with, and each member's eviction, in row order."""

    input_ids: torch.Tensor  # [members, 1]
    inputs: PassInputs  # position_ids [rows, 1]; masks [rows, 1, 1, slots]
    evictions: list[Eviction | None]  # one per member


@dataclass
class _Active:
    """The device tensors of the pass under way, read by update() for every layer."""

    rows: int  # the members
    width: int  # the sink layers' slots attention reads: as far as any row has written
    sliding_width: int
    write: torch.Tensor  # [rows] the slot each row writes in the sink layers
    sliding_write: torch.Tensor | None  # [rows] in the sliding layers
    rotations: dict[int, tuple[torch.Tensor, torch.Tensor]]  # table index -> cos, sin [rows, 1, 1, rotary_dim]
    sink_rows: torch.Tensor  # [rows, 1, sinks, 1] True where a row has that sink
    sinks: torch.Tensor  # int64 [rows]: each row's sinks


def bucket(count: int) -> int:
    """The rows a pool for `count` members is allocated with: the power of two at or above it (1, 2, 4, 8, ...)."""
    return 1 << max(0, count - 1).bit_length()


class CacheBatch(Cache):
    """The transformers Cache a batched decode pass is called with; its members are SinkCaches."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.members: list[SinkCache] = []
        # Per layer, its slot tensors (layers.py: keys, values [pool rows, heads, width, dim], an int8 cache's
        # scales) and a sink layer's sink tensors (pristine, partners [pool rows, heads, sinks, rotary_dim], an
        # int8 cache's exact sinks), each pooled.
        self._slot_pools: list[list[torch.Tensor]] = []
        self._sink_pools: list[list[torch.Tensor] | None] = []
        self._active: _Active | None = None

    # ---- membership ------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        """How many members the pool has rows for (it grows as they join, or reserve() grows it)."""
        return self._slot_pools[0][0].shape[0] if self._slot_pools else 0

    def __contains__(self, cache: object) -> bool:
        return any(member is cache for member in self.members)

    @torch.inference_mode()
    def join(self, *caches: SinkCache) -> None:
        """Make `caches` the last rows, in order: their storage is copied into the pool and becomes a view of it.

        Caches joining together grow the pool once: fresh memory is slow to come by (page faults
        on a CPU), and a pool grown 1 -> 2 -> 4 -> 8 rows as eight replies start at once is
        allocated and copied four times while every reply waits.
        """
        joining: list[SinkCache] = []
        for cache in caches:
            if cache in self or any(other is cache for other in joining):
                continue
            if not cache.ledger.sinks_full or not all(layer.is_initialized for layer in cache.ring_layers):
                raise CacheStateError("a cache joins a batch once its sinks are filled")
            if not _same_layout((self.members or joining or [cache])[0], cache):
                raise CacheStateError("every cache in a batch must be for the same model, dtype and device")
            joining.append(cache)
        if not joining:
            return
        self._ensure_room(len(self.members) + len(joining), [*self.members, *joining])
        for cache in joining:
            self._copy_in(cache, len(self.members))
            self.members.append(cache)

    @torch.inference_mode()
    def reserve(self, rows: int, like: SinkCache) -> None:
        """Room for `rows` members laid out as `like` (its sinks filled), now rather than as they join: memory
        short for them fails here, and the first replies to start together wait for no allocation."""
        if not like.ledger.sinks_full or not all(layer.is_initialized for layer in like.ring_layers):
            raise CacheStateError("a batch is reserved after a cache whose sinks are filled")
        self._ensure_room(rows, [*self.members, like])

    @torch.inference_mode()
    def leave(self, cache: SinkCache) -> None:
        """`cache` owns its storage again (a copy of its row); the last member takes its row."""
        if self._active is not None:
            raise CacheStateError("a cache cannot leave a batch during its pass")
        row = next((index for index, member in enumerate(self.members) if member is cache), None)
        if row is None:
            return
        for layer in cache.ring_layers:
            written = _written(cache, layer)
            owned = [torch.zeros_like(tensor) for tensor in layer.slot_tensors()]  # a new cache's, past them
            for own, viewed in zip(owned, layer.slot_tensors(), strict=True):
                own[:, :, :written] = viewed[:, :, :written]
            layer.bind_slot_tensors(owned)
            if isinstance(layer, SinkLayer):
                layer.bind_sink_tensors([tensor.clone() for tensor in layer.sink_tensors()])
        last = self.members.pop()
        if last is not cache:
            self.members[row] = last
            self._copy_in(last, row)

    # ---- the pass ------------------------------------------------------------------------------

    @contextmanager
    def decode_pass(
        self,
        tokens: Sequence[torch.Tensor],
        labels: Sequence[int] | None = None,
        token_ids: Sequence[int] | None = None,
    ) -> Iterator[BatchPass]:
        """One token for every member (`tokens`, one [1] tensor each, in row order), one forward pass.

        Entering plans each member's pass as its own decode_pass(label, token_id) does (room
        made, slots and angles sent, the token recorded with its label and, when given, its id)
        and marks its slots; the block runs the model; leaving closes every member's pass. An
        exception from the block leaves the members torn, as in a one-row pass.
        """
        count = len(self.members)
        if len(tokens) != count:
            raise CacheStateError(f"a batch of {count} caches got {len(tokens)} tokens")
        labels = [NO_LABEL] * count if labels is None else labels
        token_ids = [UNREAD] * count if token_ids is None else token_ids
        with torch.inference_mode(), ExitStack() as opened:
            fed = zip(self.members, labels, token_ids, strict=True)
            evictions = [opened.enter_context(member.decode_pass(label, token)) for member, label, token in fed]
            input_ids, inputs = self._open(tokens)
            try:
                yield BatchPass(input_ids, inputs, evictions)
            finally:
                self._active = None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each row's token [rows, heads, 1, dim] into its slot; the pool's rows [rows, heads, width, dim]."""
        return widened(self.store(key_states, value_states, layer_idx))

    def store(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> Stored:
        """update() for attention that reads an int8 window as it is stored (SinkCache.store): the pool's rows, or
        their QuantizedWindow."""
        active = self._active
        if active is None:
            raise CacheStateError("the batch was updated outside a pass: call the model inside batch.decode_pass")
        layer = self.members[0].ring_layers[layer_idx]
        sliding = isinstance(layer, SlidingLayer)
        width = active.sliding_width if sliding else active.width
        pooled = [pool[: active.rows, :, :width] for pool in self._slot_pools[layer_idx]]
        rows = torch.arange(active.rows, device=pooled[0].device)
        write = active.sliding_write if sliding else active.write
        for stored, new in zip(pooled, layer.encoded(key_states, value_states), strict=True):
            # Advanced indices around a slice: stored[rows, :, write] is [rows, heads, dim].
            stored[rows, :, write] = new[:, :, 0]
        sinks = self._sink_pools[layer_idx]
        if sinks is not None:
            cos, sin = active.rotations[self.members[0]._table_of[layer_idx]]
            pristine, partners = sinks[0][: active.rows], sinks[1][: active.rows]
            rotated = torch.addcmul(pristine * cos, partners, sin)
            exact_keys = sinks[2][: active.rows] if layer.kv_format == INT8 else pooled[0]
            placed = exact_keys[:, :, : pristine.shape[2], : pristine.shape[3]]
            placed.copy_(torch.where(active.sink_rows, rotated, placed))
        if layer.kv_format != INT8:
            return pooled[0], pooled[1]
        if sinks is None:  # a sliding layer: no sinks
            none = pooled[0].new_zeros(*pooled[0].shape[:2], 0, pooled[0].shape[3], dtype=layer.dtype)
            return QuantizedWindow(
                pooled[0], pooled[1], pooled[2], pooled[3], none, none, torch.zeros_like(active.sinks)
            )
        return QuantizedWindow(
            pooled[0], pooled[1], pooled[2], pooled[3], sinks[2][: active.rows], sinks[3][: active.rows], active.sinks
        )

    def decode_storage(self) -> DecodeStorage | None:
        """The open pass's rows as a kernel that writes every layer itself takes them; None
        outside a pass, or where a layer slides or layers rotate by more than one table."""
        active = self._active
        if active is None or len(active.rotations) != 1 or any(each is None for each in self._sink_pools):
            return None
        rows = active.rows
        cos, sin = next(iter(active.rotations.values()))  # [rows, 1, 1, rotary_dim]
        return DecodeStorage.of(
            [[pool[:rows] for pool in pools] for pools in self._slot_pools],
            [[pool[:rows] for pool in pools] for pools in self._sink_pools if pools is not None],
            self.members[0].kv_format,
            active.write,
            torch.tensor([member.sinks for member in self.members]),
            active.width,
            cos.reshape(rows, -1),
            sin.reshape(rows, -1),
        )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise CacheStateError("each row of a batch has its own positions: they come with the pass's inputs")

    def get_query_offset(self, layer_idx: int = 0) -> int:
        raise CacheStateError("the batch hands the model its masks: call the model inside batch.decode_pass")

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        raise CacheStateError("the batch hands the model its masks: call the model inside batch.decode_pass")

    # ---- internals -----------------------------------------------------------------------------

    def _open(self, tokens: Sequence[torch.Tensor]) -> tuple[torch.Tensor, PassInputs]:
        """Every member's slots marked and scalars sent (their decode_pass() is open): the pass's inputs."""
        members = self.members
        rows = len(members)
        first = members[0]
        device = first.device
        for member, token in zip(members, tokens, strict=True):
            member.occupancy.take_token(token.reshape(1, 1))
        scalars = torch.stack([member.occupancy.scalars for member in members])  # [members, 6]
        input_ids = torch.cat([token.reshape(1) for token in tokens])[:, None]
        # Attention reads as far as the furthest row has written: a short conversation's slots past that are
        # empty in every row.
        width = max(member.sinks + member.ledger.ring.extent for member in members)
        width = max(width, self._sink_columns())  # the sinks are placed in every row's first columns
        full = self._held([member.occupancy.held[:width] for member in members], width)
        sliding, sliding_width = None, 0
        if first.sliding is not None:
            sliding_width = max(known_sliding(member.sliding).ring.extent for member in members)
            sliding_held = [member.occupancy.sliding_held[:sliding_width] for member in members]
            sliding = self._held(sliding_held, sliding_width)
        rotations = {}
        for index, table in enumerate(first.tables):
            cos, sin = table.cos_sin_rows(scalars[:, SINK_SHIFT])
            rotations[index] = (cos[:, None, None], sin[:, None, None])  # [rows, 1, 1, rotary_dim]
        sinks = torch.tensor([member.sinks for member in members], device=device)
        widest = self._sink_columns()
        sink_rows = torch.arange(widest, device=device)[None, :] < sinks[:, None]  # [rows, sinks]
        self._active = _Active(
            rows,
            width,
            sliding_width,
            scalars[:, WRITE],
            scalars[:, SLIDING_WRITE] if first.sliding is not None else None,
            rotations,
            sink_rows[:, None, :, None],
            sinks,
        )
        position_ids = scalars[:, POSITION : POSITION + 1]  # [rows, 1]
        return input_ids, PassInputs(position_ids, self._attention_masks(full, sliding))

    @staticmethod
    def _held(held: list[torch.Tensor], width: int) -> torch.Tensor:
        """[members, width]: each member's held slots, False past its own."""
        mask = torch.zeros(len(held), width, dtype=torch.bool, device=held[0].device)
        for row, slots in enumerate(held):
            mask[row, : slots.shape[0]] = slots
        return mask

    def _attention_masks(
        self, full: torch.Tensor, sliding: torch.Tensor | None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """As SinkCache's, one query per row: 4D masks [rows, 1, 1, width]."""
        first = self.members[0]

        def shaped(held: torch.Tensor) -> torch.Tensor:
            # for_attention makes [1, 1, rows, width] -> one query per row: [rows, 1, 1, width]
            return masks.for_attention(held, first.boolean_masks, first.mask_dtype).reshape(held.shape[0], 1, 1, -1)

        return masks.per_layer_type(shaped(full), None if sliding is None else shaped(sliding), first.layer_types)

    def _sink_columns(self) -> int:
        """As many sink columns as the pool's sink layers have (the widest member's that made it)."""
        return next((pools[0].shape[2] for pools in self._sink_pools if pools is not None), 0)

    def _ensure_room(self, count: int, members: list[SinkCache]) -> None:
        """A pool with `count` rows (a bucket's worth) as wide as the widest of `members`; members moved over."""
        rows = bucket(count)
        layers = range(len(members[0].ring_layers))
        widths = [max(member.ring_layers[index].keys.shape[2] for member in members) for index in layers]
        sinks = max(member.sinks for member in members)
        if self.capacity >= rows and self._fits(widths, sinks):
            return
        rows = max(rows, self.capacity)
        template = members[0]
        self._slot_pools, self._sink_pools = [], []
        for layer, width in zip(template.ring_layers, widths, strict=True):
            # [rows, heads, width or sinks, the tensor's own last dim]
            self._slot_pools.append(
                [each.new_zeros(rows, each.shape[1], width, each.shape[3]) for each in layer.slot_tensors()]
            )
            sink_tensors = layer.sink_tensors() if isinstance(layer, SinkLayer) else None
            pooled = (
                None
                if sink_tensors is None
                else [each.new_zeros(rows, each.shape[1], sinks, each.shape[3]) for each in sink_tensors]
            )
            self._sink_pools.append(pooled)
        for row, member in enumerate(self.members):
            self._copy_in(member, row)  # from its views of the old pool, which it keeps alive until rebound

    def _fits(self, widths: list[int], sinks: int) -> bool:
        if any(pools[0].shape[2] < width for pools, width in zip(self._slot_pools, widths, strict=True)):
            return False
        return all(pools is None or pools[0].shape[2] >= sinks for pools in self._sink_pools)

    def _copy_in(self, cache: SinkCache, row: int) -> None:
        """Copy `cache`'s storage into `row` and make its layers views of that row.

        Only the slots it has written: the row's slots past them may hold an earlier member's, which its passes
        never attend to (no slot past the written ones is held) and leave() does not copy out.
        """
        for index, layer in enumerate(cache.ring_layers):
            slots, written = layer.keys.shape[2], _written(cache, layer)
            views = [pool[row : row + 1, :, :slots] for pool in self._slot_pools[index]]
            for view, own in zip(views, layer.slot_tensors(), strict=True):
                view[:, :, :written] = own[:, :, :written]
            layer.bind_slot_tensors(views)
            if isinstance(layer, SinkLayer):
                sink_pools = self._sink_pools[index]
                if sink_pools is None:
                    raise CacheStateError(f"layer {index} is a sink layer, but the pool has no sinks for it")
                sink_views = [pool[row : row + 1, :, : cache.sinks] for pool in sink_pools]
                for view, own in zip(sink_views, layer.sink_tensors(), strict=True):
                    view.copy_(own)
                layer.bind_sink_tensors(sink_views)


def _written(cache: SinkCache, layer: SinkLayer | SlidingLayer) -> int:
    """The slots of `layer` that `cache` has written at least once: the first ones (the sinks, then the ring)."""
    if isinstance(layer, SinkLayer):
        return cache.sinks + cache.ledger.ring.extent
    return known_sliding(cache.sliding).ring.extent


def _same_layout(first: SinkCache, other: SinkCache) -> bool:
    if len(first.ring_layers) != len(other.ring_layers) or first.device != other.device:
        return False
    if first.kv_format != other.kv_format:
        return False
    for mine, theirs in zip(first.ring_layers, other.ring_layers, strict=True):
        if type(mine) is not type(theirs) or mine.dtype != theirs.dtype or mine.keys.dtype != theirs.keys.dtype:
            return False
        if mine.keys.shape[1] != theirs.keys.shape[1] or mine.keys.shape[3] != theirs.keys.shape[3]:
            return False
    return True
