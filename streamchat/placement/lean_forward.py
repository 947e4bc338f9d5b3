"""The decode pass written out for the llama family: one token per row, as few operations as the math needs.

transformers' forward pass is general: every decode pass it builds masks, position
embeddings and per-layer views through about 6,000 small operations for the default model,
which on a CPU cost as much as the products. Given the sink cache's positions and masks:

    embed -> for each layer:  RMSNorm, qkv (one fused product), rotary on q and k together,
                              cache.update (the sink cache writes the slot), attention
                              (placement/attention.py: each KV head read once), o_proj,
                              residual, RMSNorm, gate_up (one fused product), SiLU(gate) * up,
                              down, residual
          -> final RMSNorm -> lm_head

The same operations as the model's own modules, in the same dtypes, so float32 logits
agree with `model(...)` to rounding and bfloat16 ones within its bounds
(tests/placement/test_lean_forward.py). Rows of a batch may sit at different positions
under different masks. It takes the fused layers placement/fusion.py made at load time;
models without them run their own forward (lean_forward_for gives None).

`ragged` runs one pass of tokens from several caches, vLLM's way: the tokens of every
segment (a batch's decode rows, one token each, or a prompt chunk of one conversation)
go through the products together, as one [1, tokens, hidden] input that reads each weight
once, and only attention runs per segment, through its own cache and mask (a chunk
through the attention the model's own forward calls).

The fused decode (FusedDecode): even written out, a one-token pass is about 1,400 torch
operators for the default model, half of a 9 ms pass on a 2-core CPU. Where the native
kernels run the layers anyway (int4 weights through TiledInt4Linear, bfloat16 activations,
rows of a SinkCache or a pool whose layers all keep sinks), one call of
kernels/decode_layers.c runs every layer of the pass for every row, the cache's slot writes
and sink rotations included, rounding as these operators round: its logits and caches equal
this module's, bit for bit (tests/placement/test_fused_decode.py). Python keeps the
embedding, the rotary angles, the final norm and the head.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from streamchat.cache.batch import CacheBatch
from streamchat.cache.layers import DecodeStorage
from streamchat.cache.quantized_kv import INT8, Stored
from streamchat.cache.sink_cache import SinkCache
from streamchat.errors import CacheStateError
from streamchat.placement.attention import decode_attention_stored, decode_mask, streamchat_attention_forward
from streamchat.placement.fusion import FusedProjection, fusable
from streamchat.placement.native import NativeKernels, native_in_use
from streamchat.placement.native_layers import TiledInt4Linear

LEAN_ACTIVATIONS = frozenset({"silu"})
MAX_HEAD_DIM = 256  # what the attention kernel takes
MAX_GROUPS = 16  # query heads per key/value head the attention kernel takes


class _Layer(NamedTuple):
    """What one decoder layer reads, gathered once."""

    number: int  # from 0 (not `index`: a tuple's method)
    input_norm: torch.Tensor  # [hidden]
    qkv: FusedProjection
    o_proj: torch.nn.Module
    post_norm: torch.Tensor  # [hidden]
    gate_up: FusedProjection
    down: torch.nn.Module
    layer_type: str  # which of a dict of masks this layer takes
    attention: torch.nn.Module  # the model's attention module, which transformers' sdpa path reads settings from


class Segment(NamedTuple):
    """Consecutive tokens of a ragged pass that attend through one cache."""

    length: int  # how many of the pass's tokens
    cache: Any  # decode rows: the pool (a CacheBatch) or one reply's SinkCache; a chunk: its conversation's SinkCache
    mask: torch.Tensor | dict[str, torch.Tensor]  # as the cache's pass handed it over
    decode: bool  # one token for each of `length` rows, or one row of `length` tokens


class LeanForward:
    """logits [batch, 1, vocab] for input_ids [batch, 1] at position_ids [batch, 1] through `cache`."""

    def __init__(self, model: Any) -> None:
        config = model.config.get_text_config(decoder=True)
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.head = model.get_output_embeddings()
        # A plain head on a CPU, for which rows go through BLAS weight-first (_logits).
        plain = type(self.head) is torch.nn.Linear and self.head.bias is None
        self._weight_major_head = plain and self.head.weight.device.type == "cpu"
        self.eps = config.rms_norm_eps
        first = inner.layers[0].self_attn
        self.head_dim = first.head_dim
        self.scaling = first.scaling
        self.q_heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(inner.layers)
        self.layers = [
            _Layer(
                index,
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
                layer_types[index],
                layer.self_attn,
            )
            for index, layer in enumerate(inner.layers)
        ]
        # Every layer of a one-token pass in one native call, where the layers are native int4.
        self.fused = FusedDecode.for_layers(
            self.layers, self.q_heads, self.kv_heads, self.head_dim, self.eps, self.scaling
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | dict[str, torch.Tensor],
        cache: Any,
    ) -> torch.Tensor:
        batch = input_ids.shape[0]
        hidden = self.embed(input_ids)  # [batch, 1, hidden]
        cos, sin = self.rotary(hidden, position_ids)  # [batch, 1, head_dim], the model's dtype
        cos, sin = cos[:, :, None], _signed(sin)[:, :, None]  # [batch, 1, 1, head_dim]
        masks = _each_mask(attention_mask, decode_mask)  # converted once per pass, not once per layer
        fused = None if self.fused is None else self.fused(hidden, cos, sin, masks, cache)
        if fused is not None:
            return self._logits(self._norm(fused, self.final_norm))
        for layer in self.layers:
            mask = masks[layer.layer_type] if isinstance(masks, dict) else masks
            query_key, value = self._projections(layer, hidden)
            rotated = query_key * cos + query_key.roll(self.head_dim // 2, dims=-1) * sin
            queries, keys = rotated.split((self.q_heads, self.kv_heads), dim=2)
            stored = _store(cache, keys.transpose(1, 2), value.transpose(1, 2), layer.number)
            # [batch, 1, q_heads, head_dim] -> [batch, q_heads, 1, head_dim]; out [batch, 1, q_heads, head_dim].
            attended = decode_attention_stored(queries.transpose(1, 2), stored, mask, self.scaling)
            hidden = hidden + layer.o_proj(attended.reshape(batch, 1, self.q_heads * self.head_dim))
            gate, up = layer.gate_up.linear(self._norm(hidden, layer.post_norm)).chunk(2, dim=-1)
            hidden = hidden + layer.down(torch.nn.functional.silu(gate) * up)
        return self._logits(self._norm(hidden, self.final_norm))

    def ragged(self, input_ids: torch.Tensor, position_ids: torch.Tensor, segments: Sequence[Segment]) -> torch.Tensor:
        """Logits [1, outputs, vocab] for input_ids [tokens] at position_ids [tokens], cut into `segments` in order:
        one output for each decode row and one for each chunk's last token, in the order of the segments."""
        hidden = self.embed(input_ids)[None]  # [1, tokens, hidden]
        cos, sin = self.rotary(hidden, position_ids[None])  # [1, tokens, head_dim]
        cos, sin = cos[:, :, None], _signed(sin)[:, :, None]  # [1, tokens, 1, head_dim]
        # A decode segment's masks as decode_attention takes them, converted once per pass.
        masks = [_each_mask(segment.mask, decode_mask) if segment.decode else segment.mask for segment in segments]
        for layer in self.layers:
            query_key, value = self._projections(layer, hidden)
            rotated = query_key * cos + query_key.roll(self.head_dim // 2, dims=-1) * sin
            queries, keys = rotated.split((self.q_heads, self.kv_heads), dim=2)
            attended, start = [], 0
            for segment, mask in zip(segments, masks, strict=True):
                span = slice(start, start + segment.length)
                mask = mask[layer.layer_type] if isinstance(mask, dict) else mask
                attend = self._attend_rows if segment.decode else self._attend_chunk
                attended.append(attend(layer, segment.cache, queries[:, span], keys[:, span], value[:, span], mask))
                start += segment.length
            hidden = hidden + layer.o_proj(attended[0] if len(attended) == 1 else torch.cat(attended, dim=1))
            gate, up = layer.gate_up.linear(self._norm(hidden, layer.post_norm)).chunk(2, dim=-1)
            hidden = hidden + layer.down(torch.nn.functional.silu(gate) * up)
        last: list[int] = []
        start = 0
        for segment in segments:
            start += segment.length
            last.extend(range(start - segment.length, start) if segment.decode else [start - 1])
        kept = hidden[:, last] if len(last) < hidden.shape[1] else hidden
        return self._logits(self._norm(kept, self.final_norm))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's product of hidden [..., hidden] -> logits [..., vocab].

        For several rows on a CPU, as weight @ rows.T: BLAS then splits the head's rows (the
        vocabulary, 49152 for the default model) over the threads, where F.linear's call
        runs 2-32 rows 1.5-1.8x slower (scripts/row_product_figures.py). One row is a
        matrix-vector product either way, and is left to the module."""
        rows = hidden.reshape(-1, hidden.shape[-1])  # [..., hidden] -> [rows, hidden]
        if rows.shape[0] == 1 or not self._weight_major_head:
            return self.head(hidden)
        return torch.mm(self.head.weight, rows.t()).t().reshape(*hidden.shape[:-1], -1)

    def _attend_rows(
        self, layer: _Layer, cache: Any, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any
    ) -> torch.Tensor:
        """Decode rows: queries [1, rows, q_heads, head_dim] -> attended [1, rows, q_heads * head_dim]."""
        rows = queries.shape[1]
        # [1, rows, heads, head_dim] -> [rows, heads, 1, head_dim]: a row's token is its own query.
        stored = _store(cache, keys[0, :, :, None], values[0, :, :, None], layer.number)
        attended = decode_attention_stored(queries[0, :, :, None], stored, mask, self.scaling)
        return attended.reshape(1, rows, self.q_heads * self.head_dim)

    def _attend_chunk(
        self, layer: _Layer, cache: Any, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: Any
    ) -> torch.Tensor:
        """A prompt chunk: queries [1, n, q_heads, head_dim] -> attended [1, n, q_heads * head_dim], through
        torch's attention as the model's own forward runs it (a chunk of one as a decode query). On a CPU, each
        key/value head is read by its query heads where it lies: transformers' sdpa path, given a mask, copies
        them once per query head first (repeat_kv), a copy of the whole cache per layer and chunk. (On a GPU,
        torch's kernels that take a mask do not take grouped heads, so its path stays.)"""
        length = queries.shape[1]
        keys, values = cache.update(keys.transpose(1, 2), values.transpose(1, 2), layer.number)
        if length == 1 or mask is None or queries.device.type != "cpu":
            attended, _ = streamchat_attention_forward(
                layer.attention, queries.transpose(1, 2), keys, values, mask, dropout=0.0, scaling=self.scaling
            )
        else:
            attended = torch.nn.functional.scaled_dot_product_attention(
                queries.transpose(1, 2),  # [1, n, heads, dim] -> [1, heads, n, dim]
                keys,
                values,
                attn_mask=mask[:, :, :, : keys.shape[-2]],
                scale=self.scaling,
                enable_gqa=True,
            ).transpose(1, 2)  # [1, heads, n, dim] -> [1, n, heads, dim]
        return attended.reshape(1, length, self.q_heads * self.head_dim)

    def _projections(self, layer: _Layer, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as [batch, n, q_heads + kv_heads, head_dim], v as [batch, n, kv_heads, head_dim]."""
        batch, length = hidden.shape[:2]
        fused = layer.qkv.linear(self._norm(hidden, layer.input_norm))  # [batch, n, (q + 2 kv) * head_dim]
        split = (self.q_heads + self.kv_heads) * self.head_dim
        query_key = fused[..., :split].reshape(batch, length, self.q_heads + self.kv_heads, self.head_dim)
        value = fused[..., split:].reshape(batch, length, self.kv_heads, self.head_dim)
        return query_key, value

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """LlamaRMSNorm's operations: in float32, then back to the model's dtype before the weight (in one call
        of the native kernel where it is in use: nine of torch's, 61 norms a pass of the default model)."""
        native = native_in_use()
        if native is not None and hidden.device.type == "cpu" and not torch.compiler.is_compiling():
            normed = native.rms_norm(hidden, weight, self.eps)
            if normed is not None:
                return normed
        wide = hidden.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * wide.to(hidden.dtype)


def _store(cache: Any, keys: torch.Tensor, values: torch.Tensor, number: int) -> Stored:
    """The pass's keys and values [batch, kv_heads, n, head_dim] written: what attention reads, as the cache
    stores it where it can say (a sink cache's int8 window, read without widening it), else its update's."""
    store = getattr(cache, "store", None)
    return cache.update(keys, values, number) if store is None else store(keys, values, number)


def _each_mask(mask: Any, convert: Any) -> Any:
    """`convert` applied to a mask, or to each of a dict of masks."""
    return {kind: convert(each) for kind, each in mask.items()} if isinstance(mask, dict) else convert(mask)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: x * cos + roll(x, half) * signed sin is rotate_half's rotation."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def lean_forward_for(model: Any) -> LeanForward | None:
    """The lean forward for `model`, or None where it has no fused layers or is not plain llama in shape."""
    if not fusable(model):
        return None
    config = model.config.get_text_config(decoder=True)
    layers = model.model.layers
    if not all(isinstance(getattr(layer.self_attn, "qkv_proj", None), FusedProjection) for layer in layers):
        return None
    if not all(isinstance(getattr(layer.mlp, "gate_up_proj", None), FusedProjection) for layer in layers):
        return None
    if config.hidden_act not in LEAN_ACTIVATIONS or getattr(config, "head_dim", None) not in (
        None,
        layers[0].self_attn.head_dim,
    ):
        return None
    return LeanForward(model)


# ---- the fused decode: every layer in one native call ----------------------------------------


def _projection(linear: TiledInt4Linear) -> list[int]:
    """A projection's fields in decode_layers.c's table: nibbles, params, bias (0: none)."""
    bias = 0 if linear.bias is None else linear.bias.data_ptr()
    return [linear.nibbles.data_ptr(), linear.params.data_ptr(), bias]


class FusedDecode:
    """hidden [rows, 1, hidden_size] after every layer of a one-token pass, through the native kernel."""

    def __init__(
        self, layers: Sequence[Any], kernels: NativeKernels, dims: list[int], eps: float, scale: float
    ) -> None:
        self.layers = layers  # held: the table points into their tensors
        self.kernels = kernels
        self.weights = [
            [
                layer.input_norm.data_ptr(),
                layer.post_norm.data_ptr(),
                *_projection(layer.qkv.linear),
                *_projection(layer.o_proj),
                *_projection(layer.gate_up.linear),
                *_projection(layer.down),
            ]
            for layer in layers
        ]
        self.dims = dims  # hidden_size, q_heads, kv_heads, head_dim, intermediate
        self.eps, self.scale = eps, scale
        # The last table and the addresses it holds: a cache's storage stays put from step to step (it moves when
        # a pool grows), and checking and laying out 30 layers' tensors every step was 5 % of the default model's.
        self._laid_out: tuple[tuple[Any, ...], torch.Tensor] | None = None

    @classmethod
    def for_layers(
        cls, layers: Sequence[Any], q_heads: int, kv_heads: int, head_dim: int, eps: float, scale: float
    ) -> FusedDecode | None:
        """The fused decode over the lean forward's layers, or None where a layer is not one the kernel runs."""
        projections = [(layer.qkv.linear, layer.o_proj, layer.gate_up.linear, layer.down) for layer in layers]
        if not all(isinstance(each, TiledInt4Linear) for four in projections for each in four):
            return None
        if any(each.bias is not None and each.bias.dtype != torch.bfloat16 for four in projections for each in four):
            return None
        norms = [norm for layer in layers for norm in (layer.input_norm, layer.post_norm)]
        if not all(norm.dtype == torch.bfloat16 and norm.is_contiguous() for norm in norms):
            return None
        if any(layer.layer_type != "full_attention" for layer in layers):
            return None
        if head_dim % 16 or head_dim > MAX_HEAD_DIM or q_heads % kv_heads or q_heads // kv_heads > MAX_GROUPS:
            return None
        hidden_size, intermediate = layers[0].input_norm.numel(), layers[0].gate_up.linear.out_features // 2
        dims = [hidden_size, q_heads, kv_heads, head_dim, intermediate]
        return cls(layers, projections[0][0].kernels, dims, eps, scale)

    def __call__(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: Any, cache: Any
    ) -> torch.Tensor | None:
        """hidden [rows, 1, hidden_size] bfloat16 through every layer, the cache's pass written; None (nothing
        done) where the pass is not one the kernel takes: cos, sin [rows, 1, 1, head_dim] (sin signed), the
        decode mask as decode_mask made it."""
        if native_in_use() is None or torch.compiler.is_compiling() or not isinstance(cache, (SinkCache, CacheBatch)):
            return None
        if hidden.dtype != torch.bfloat16 or hidden.device.type != "cpu":
            return None
        storage = cache.decode_storage()
        rows = hidden.shape[0]
        if storage is None or storage.slots.numel() != rows or not _takes_mask(mask, rows, storage.extent):
            return None
        layers = _stored_per_layer(storage)
        keys, values, pristine, _, scales, _, exact, _ = layers[0]  # exact: an int8 cache's sink keys, else the keys
        if exact.dtype != torch.bfloat16 or (table := self._table_for(layers)) is None:
            return None
        strides = [keys.stride(0), keys.stride(1), values.stride(0), values.stride(1)]
        strides += [pristine.stride(0), pristine.stride(1)]
        int8 = [int(storage.kv_format == INT8), scales.stride(0), scales.stride(1), exact.stride(0), exact.stride(1)]
        dims = torch.tensor([*self.dims, rows, *strides, pristine.shape[3], storage.extent, *int8])
        out = hidden.clone(memory_format=torch.contiguous_format)
        cos, sin, sink_cos, sink_sin = (each.contiguous() for each in (cos, sin, storage.sink_cos, storage.sink_sin))
        slots, sinks = storage.slots.contiguous(), storage.sinks
        self.kernels.decode_layers(
            table, dims, slots, sinks, out, cos, sin, sink_cos, sink_sin, mask, self.eps, self.scale
        )
        return out

    def _table_for(self, layers: list[tuple[torch.Tensor, ...]]) -> torch.Tensor | None:
        """decode_layers.c's table: each layer's weights then its stored tensors (_stored_per_layer's); None where
        the layers' tensors are not alike. Laid out again only where the storage has moved."""
        addresses = tuple(tensor.data_ptr() for layer in layers for tensor in layer)
        key = (addresses, tuple(tensor.stride() for tensor in layers[0]))  # a pool's layers all move alike
        if self._laid_out is not None and self._laid_out[0] == key:
            return self._laid_out[1]
        if len(layers) != len(self.weights) or not _alike(layers):
            return None
        width = len(layers[0])  # each layer's weights, then its stored tensors' addresses
        table = torch.tensor([[*each, *addresses[width * n : width * (n + 1)]] for n, each in enumerate(self.weights)])
        self._laid_out = (key, table)
        return table


def _stored_per_layer(storage: DecodeStorage) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's tensors in decode_layers.c's table order: keys, values, pristine, partners, then the key and
    value scales and the exact sinks of an int8 cache (a full cache: the keys and values again, which hold its
    sinks; their scales are never read)."""
    if storage.kv_format == INT8:
        tail = _int8_tensors(storage)
    else:
        tail = (storage.keys, storage.values, storage.keys, storage.values)
    return list(zip(storage.keys, storage.values, storage.pristine, storage.partners, *tail, strict=True))


def _int8_tensors(storage: DecodeStorage) -> tuple[list[torch.Tensor], ...]:
    """An int8 cache's key scales, value scales, sink keys and sink values, per layer."""
    key_scales, value_scales, sink_keys, sink_values = (
        storage.key_scales, storage.value_scales, storage.sink_keys, storage.sink_values,
    )  # fmt: skip
    if key_scales is None or value_scales is None or sink_keys is None or sink_values is None:
        raise CacheStateError(f"a {storage.kv_format} cache's decode storage has no int8 tensors")
    return key_scales, value_scales, sink_keys, sink_values


def _alike(layers: list[tuple[torch.Tensor, ...]]) -> bool:
    """Whether every layer's tensors (_stored_per_layer's) have the first's strides, and keys and values alike,
    scales alike, exact sinks alike (decode_layers.c takes one set)."""
    strides = [[tensor.stride() for tensor in layer] for layer in layers]
    first = strides[0]
    return all(first[2 * i + 2] == first[2 * i + 3] for i in range(3)) and all(each == first for each in strides)


def _takes_mask(mask: Any, rows: int, extent: int) -> bool:
    """A float32 mask over the pass's slots, a row each, contiguous (decode_mask's), or none."""
    if mask is None:
        return True
    taken = isinstance(mask, torch.Tensor) and mask.dtype == torch.float32 and mask.is_contiguous()
    return taken and mask.numel() == rows * extent
