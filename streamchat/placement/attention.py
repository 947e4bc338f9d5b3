"""streamchat's attention: a decode query reads each key/value head once, eager and compiled.

transformers' "sdpa" attention packs a decode query's heads per key/value head only
outside torch.compile (`not is_torchdynamo_compiling()` in its sdpa_attention.py); a
compiled graph falls back to `repeat_kv`, which copies every key and value head
group-size times before SDPA reads them. Here one decode query always runs packed: the
group's query heads become rows of one query per key/value head, which reads the
cache as it is stored: through SDPA on accelerators; on CPU through streamchat's own kernel
where they are in use (native.use_native_kernels; kernels/decode_attention.c: a bfloat16 layer over
a short cache 17 us against 107, over 2,004 slots 103 against 226), else through two matrix
products and a float32 softmax, which run at about twice SDPA's speed for a few query rows
(README, Benchmarks). Prompt chunks (more than one query) run exactly as transformers' sdpa
path runs them.

The function is registered under ATTENTION_NAME in transformers' AttentionInterface (and
its mask creation is sdpa's), so a model loaded with `attn_implementation=ATTENTION_NAME`
calls it in every attention layer; `decode_attention` is the same decode path for callers
that run their own forward.
"""

from __future__ import annotations

from typing import Any, overload

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from streamchat.cache.masks import STREAMCHAT_ATTENTION
from streamchat.cache.quantized_kv import QuantizedWindow, Stored
from streamchat.placement.native import native_in_use

ATTENTION_NAME = STREAMCHAT_ATTENTION


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention of one query position per row, reading each key/value head once; returns [B, 1, H, Dv].

    query [B, H, 1, D]; keys [B, KV, S, D] and values [B, KV, S, Dv] as the cache stores
    them (H a multiple of KV); mask [B or 1, 1, 1, S], boolean (True: attend) or added to
    the scores, shared by every head, or None to attend to all S. `scale` defaults to
    D ** -0.5 as in SDPA.
    """
    batch, heads, _, head_dim = query.shape
    kv_heads = keys.shape[1]
    groups = heads // kv_heads
    # [B, H, 1, D] -> [B, KV, G, D]: head h = kv * G + g, the order repeat_kv pairs them in.
    packed = query.reshape(batch, kv_heads, groups, head_dim)
    if packed.device.type == "cpu" and dropout == 0.0:
        scale = head_dim**-0.5 if scale is None else scale
        attended = _native_attention(packed, keys, values, mask, scale)
        if attended is None:
            attended = _products_attention(packed, keys, values, mask, scale)
    else:
        # The mask [B, 1, 1, S] broadcasts over the KV heads and the G rows of each.
        attended = torch.nn.functional.scaled_dot_product_attention(
            packed, keys, values, attn_mask=mask, dropout_p=dropout, scale=scale
        )
    # [B, KV, G, Dv] -> [B, 1, H, Dv]: a view, as the G rows of a head group are contiguous.
    return attended.reshape(attended.shape[0], 1, heads, values.shape[-1])


def decode_attention_stored(
    query: torch.Tensor, stored: Stored, mask: torch.Tensor | None, scale: float | None = None
) -> torch.Tensor:
    """decode_attention over what a cache's store() gave: keys and values, or an int8 window, which the native
    kernel reads as it is stored (half the bytes of bfloat16) and anything else reads widened, one layer's at a
    time. query [B, H, 1, D]; returns [B, 1, H, Dv]."""
    if not isinstance(stored, QuantizedWindow):
        return decode_attention(query, *stored, mask, scale)
    native = native_in_use()
    batch, heads, _, head_dim = query.shape
    kv_heads = stored.keys.shape[1]
    if native is not None and query.device.type == "cpu" and not torch.compiler.is_compiling():
        # [B, H, 1, D] -> [B, KV, G, D], as decode_attention packs it.
        packed = query.reshape(batch, kv_heads, heads // kv_heads, head_dim).contiguous()
        scale = head_dim**-0.5 if scale is None else scale
        attended = native.decode_attention_int8(packed, stored, decode_mask(mask), scale)
        if attended is not None:
            # [B, KV, G, Dv] -> [B, 1, H, Dv]
            return attended.reshape(batch, 1, heads, attended.shape[-1])
    return decode_attention(query, *stored.widened(), mask, scale)


@overload
def decode_mask(mask: torch.Tensor) -> torch.Tensor: ...


@overload
def decode_mask(mask: torch.Tensor | None) -> torch.Tensor | None: ...


def decode_mask(mask: torch.Tensor | None) -> torch.Tensor | None:
    """`mask` as decode_attention takes it fastest on its device: convert once for many layers.

    A caller running every layer under one mask converts it once per pass
    (placement/lean_forward.py). On CPU a mask becomes float32 terms added to the scores (a
    boolean one: the least float32 where a slot is hidden), so the masked scores and the
    softmax stay float32 whatever the model's dtype; elsewhere SDPA takes it as it is.
    """
    if mask is None or mask.device.type != "cpu":
        return mask
    if mask.dtype != torch.bool:
        return mask.float()
    return torch.zeros(mask.shape).masked_fill_(~mask, torch.finfo(torch.float32).min)


def _native_attention(
    packed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor | None:
    """[B, KV, G, Dv] through the native kernel; None where there is none or it does not take these tensors.

    bfloat16 only: that is where torch's products cost ~100 us a call; float32 ones do not, and
    float32 stays exactly what transformers' attention computes. A compiled graph keeps torch's
    products too: a graph cannot trace a foreign call, and it fuses them itself.
    """
    native = native_in_use()
    if native is None or packed.dtype != torch.bfloat16 or torch.compiler.is_compiling():
        return None
    return native.decode_attention(packed.contiguous(), keys, values, decode_mask(mask), scale)


def _products_attention(
    packed: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """[B, KV, G, Dv] by two matrix products and a float32 softmax: on CPU, for a few query rows.

    CPU SDPA splits its work by query rows and heads, G x KV of them here (9 for the
    default model on 2 cores), and converts a boolean mask per call; two products over the
    same keys run about twice as fast. Scores are rounded to the cache's dtype as transformers'
    eager attention rounds them; the scaling, the mask and the softmax run in float32.
    """
    scores = torch.matmul(packed, keys.transpose(-1, -2))  # [B, KV, G, S]
    if mask is None:
        weights = torch.softmax(scores.float() * scale, dim=-1)
    else:
        # One fused widening, scaling and masking: mask + scale * scores, in float32.
        weights = torch.softmax(torch.add(decode_mask(mask), scores, alpha=scale), dim=-1)
    return torch.matmul(weights.to(values.dtype), values)


def streamchat_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, q, D], key/value [B, KV, S, D]; out [B, q, H, Dv].

    One query with a mask shared by the heads runs `decode_attention`; everything else
    (prompt chunks, per-head masks, position biases, softcapping's refusal) is
    transformers' sdpa path, unchanged.
    """
    decoding = (
        query.shape[2] == 1
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and (attention_mask is None or attention_mask.shape[1] == 1)
    )
    if not decoding:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    return decode_attention(query, key, value, attention_mask, scaling, dropout), None


def register_attention() -> str:
    """Make ATTENTION_NAME a valid `attn_implementation` (idempotent); returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, streamchat_attention_forward)
    # Models build their own masks for it exactly as for sdpa (boolean, None when causal suffices).
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)
    return ATTENTION_NAME
