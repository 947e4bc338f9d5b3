"""The decode step written out for the llama family: one token per row, as few operations as the math needs.

transformers' forward pass is general: every decode step it builds masks, position
embeddings and per-layer views through a few thousand small operations and the Python
around them, which on a CPU cost as much as the matrix products (issue 22: about 6,000
aten calls a token for the default model). Once the sink cache hands over the positions
and the masks, one token's step needs little of that:

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
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from streamchat.placement.attention import decode_attention, decode_mask
from streamchat.placement.fusion import FusedProjection, fusable

LEAN_ACTIVATIONS = frozenset({"silu"})


class _Layer(NamedTuple):
    """What one decoder layer's step reads, gathered once."""

    index: int
    input_norm: torch.Tensor  # [hidden]
    qkv: FusedProjection
    o_proj: torch.nn.Module
    post_norm: torch.Tensor  # [hidden]
    gate_up: FusedProjection
    down: torch.nn.Module
    layer_type: str  # which of a dict of masks this layer takes


class LeanForward:
    """logits [batch, 1, vocab] for input_ids [batch, 1] at position_ids [batch, 1] through `cache`."""

    def __init__(self, model: Any) -> None:
        config = model.config.get_text_config(decoder=True)
        inner = model.model
        self.embed = inner.embed_tokens
        self.rotary = inner.rotary_emb
        self.final_norm = inner.norm.weight
        self.head = model.get_output_embeddings()
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
            )
            for index, layer in enumerate(inner.layers)
        ]

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
        # Converted once per step, not once per layer.
        if isinstance(attention_mask, dict):
            masks = {kind: decode_mask(mask) for kind, mask in attention_mask.items()}
        else:
            masks = decode_mask(attention_mask)
        for layer in self.layers:
            mask = masks[layer.layer_type] if isinstance(masks, dict) else masks
            query_key, value = self._projections(layer, hidden, batch)
            rotated = query_key * cos + query_key.roll(self.head_dim // 2, dims=-1) * sin
            queries, keys = rotated.split((self.q_heads, self.kv_heads), dim=2)
            keys, values = cache.update(keys.transpose(1, 2), value.transpose(1, 2), layer.index)
            # [batch, 1, q_heads, head_dim] -> [batch, q_heads, 1, head_dim]; out [batch, 1, q_heads, head_dim].
            attended = decode_attention(queries.transpose(1, 2), keys, values, mask, self.scaling)
            hidden = hidden + layer.o_proj(attended.reshape(batch, 1, self.q_heads * self.head_dim))
            gate, up = layer.gate_up.forward(self._norm(hidden, layer.post_norm))
            hidden = hidden + layer.down(torch.nn.functional.silu(gate) * up)
        return self.head(self._norm(hidden, self.final_norm))

    def _projections(self, layer: _Layer, hidden: torch.Tensor, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q and k as [batch, 1, q_heads + kv_heads, head_dim], v as [batch, 1, kv_heads, head_dim]."""
        fused = layer.qkv.linear(self._norm(hidden, layer.input_norm))  # [batch, 1, (q + 2 kv) * head_dim]
        split = (self.q_heads + self.kv_heads) * self.head_dim
        query_key = fused[..., :split].reshape(batch, 1, self.q_heads + self.kv_heads, self.head_dim)
        value = fused[..., split:].reshape(batch, 1, self.kv_heads, self.head_dim)
        return query_key, value

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """LlamaRMSNorm's operations: in float32, then back to the model's dtype before the weight."""
        wide = hidden.float()
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * wide.to(hidden.dtype)


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin with its first half negated: x * cos + roll(x, half) * signed sin is rotate_half's rotation."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def lean_forward_for(model: Any) -> LeanForward | None:
    """The lean step for `model`, or None where it has no fused layers or is not plain llama in shape."""
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
