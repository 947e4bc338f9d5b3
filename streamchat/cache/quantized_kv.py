"""The KV window in int8: each token's key and value of each head as int8 levels and one float32 scale.

    levels, scales = quantize(keys)              # keys [..., dim] -> int8 [..., dim], float32 [..., 1]
    dequantize(levels, scales, torch.bfloat16)   # back: levels * scale, rounded once to the dtype

At a full cache the window is as many bytes as the default model's weights (4 + 2000
slots x 30 layers x 3 heads x 64 x 2 x 2 bytes: 46 MB), and a decode pass reads all of
it. In int8 with a scale per token and head it is 64 + 4 bytes a head's vector against
128 in bfloat16. The scale is symmetric (|x| <= 127 * scale, no zero point): keys and
values of a head are centred near zero, and a scale per token (rather than per channel)
lets each token be written once, as it comes, and never requantized.

The sinks stay exact: a sink layer keeps them apart in the model's dtype (layers.py), and
attention reads a row's first `sinks` slots from there (QuantizedWindow). Rounding, the
same here and in the native kernels (kernels/decode_layers.c) so that both write the same
bytes: scale = max |x| / 127 in float32, level = x / scale rounded half to even.
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import torch

from streamchat.errors import CacheConfigError

KVFormat = Literal["full", "int8"]
FULL: KVFormat = "full"
INT8: KVFormat = "int8"
KV_FORMATS: tuple[KVFormat, ...] = (FULL, INT8)
# Where a loaded model carries the KV format its caches take (the loader sets it; SinkCache.for_model reads it).
KV_FORMAT_ATTRIBUTE = "streamchat_kv_format"
LEVELS = 127  # the largest level: symmetric, so -127..127 (-128 is never written)
SCALE_BYTES = 4  # a float32 scale a token's key or value of a head


def kv_format_of(model: Any) -> KVFormat:
    """The KV format caches for `model` take: what the loader set on it, else the full one."""
    return getattr(model, KV_FORMAT_ATTRIBUTE, FULL)


def checked_format(name: str) -> KVFormat:
    """`name` as a KV format; CacheConfigError when it names none."""
    if name not in KV_FORMATS:
        raise CacheConfigError(f"unknown KV format {name!r}; expected one of {', '.join(KV_FORMATS)}")
    return name


def token_bytes(config: Any, kv_format: KVFormat, element_bytes: int) -> int:
    """Bytes one cached token's keys and values take over every layer of a model with `config`: `element_bytes`
    a value in the full format (the model's dtype), a level and a scale a head's vector in int8."""
    text = config.get_text_config(decoder=True)
    heads: int = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim: int = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    layers: int = text.num_hidden_layers
    vector = head_dim + SCALE_BYTES if kv_format == INT8 else head_dim * element_bytes
    return 2 * layers * heads * vector


def model_token_bytes(model: Any, kv_format: KVFormat) -> int:
    """token_bytes of `model`'s caches in `kv_format`: a full cache holds the model's dtype."""
    return token_bytes(model.config, kv_format, model.dtype.itemsize)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., dim] as int8 levels [..., dim] and float32 scales [..., 1], one per vector."""
    wide = x.float()
    scales = wide.abs().amax(dim=-1, keepdim=True) / LEVELS
    # An all-zero vector has scale 0: its levels are 0 / tiny = 0.
    levels = torch.round(wide / scales.clamp_min(torch.finfo(torch.float32).tiny)).clamp_(-LEVELS, LEVELS)
    return levels.to(torch.int8), scales


def dequantize(levels: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """levels [..., dim] * scales [..., 1], in `dtype`."""
    return (levels.float() * scales).to(dtype)


class QuantizedWindow(NamedTuple):
    """What attention reads from an int8 cache: the levels and scales of every slot it reads, and each row's
    exact sinks. Slot s of row b is sink_keys[b, :, s] if s < sinks[b], else levels * scale."""

    keys: torch.Tensor  # int8 [batch, kv_heads, slots, dim]
    values: torch.Tensor  # int8 [batch, kv_heads, slots, value_dim]
    key_scales: torch.Tensor  # float32 [batch, kv_heads, slots, 1]
    value_scales: torch.Tensor
    sink_keys: torch.Tensor  # the model's dtype [batch, kv_heads, sink slots, dim]
    sink_values: torch.Tensor
    sinks: torch.Tensor  # int64 [batch]: how many of the first slots are each row's sinks

    @property
    def dtype(self) -> torch.dtype:
        """The dtype attention computes in: the model's."""
        return self.sink_keys.dtype

    def widened(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [batch, kv_heads, slots, dim] in the model's dtype, the sinks exact: for attention that
        takes only tensors (a prompt chunk's, a model's own forward), one layer's window at a time."""
        keys = dequantize(self.keys, self.key_scales, self.dtype)
        values = dequantize(self.values, self.value_scales, self.dtype)
        columns = min(self.sink_keys.shape[2], keys.shape[2])
        if columns:
            # [batch] -> [batch, 1, columns, 1]: True where a column is one of the row's sinks.
            exact = (torch.arange(columns, device=keys.device) < self.sinks[:, None])[:, None, :, None]
            keys[:, :, :columns] = torch.where(exact, self.sink_keys[:, :, :columns], keys[:, :, :columns])
            values[:, :, :columns] = torch.where(exact, self.sink_values[:, :, :columns], values[:, :, :columns])
        return keys, values


Stored = tuple[torch.Tensor, torch.Tensor] | QuantizedWindow  # what a cache's layer gives attention to read


def widened(stored: Stored) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as tensors in the model's dtype, whatever the format they are stored in."""
    return stored.widened() if isinstance(stored, QuantizedWindow) else stored
