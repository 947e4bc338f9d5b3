"""What the cache needs to know of each attention layer: its rotary frequencies and sliding window.

Read from a loaded transformers model; kept apart from architectures.py so that the list of
supported model types can be read without loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import get_layer_types_and_kwargs

from streamchat.cache.architectures import RotaryLayout, ensure_supported
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


def _rotary_module(model: Any) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return module
    raise UnsupportedModelError(f"model type '{model.config.model_type}' has no rotary embedding module")
