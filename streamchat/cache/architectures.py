"""Which model types the sink cache supports, how each lays out its rotary dimensions, and what each of a
model's attention layers is to the cache (LayerSpec: its rotary frequencies, its own sliding window).

A model type is listed only once the exactness test against the naive reference
(tests/cache/test_against_reference.py) passes for it. Everything else is refused
with a message naming the model type and this list. Importing this module costs no torch
(the CLI lists the types); reading a model's layers imports what the model needs anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

from streamchat.errors import UnsupportedModelError

if TYPE_CHECKING:
    import torch

RotaryLayout = Literal["rotate_half", "interleaved"]

# model_type -> how rotary pairs are laid out along head_dim.
#   rotate_half: dimension i pairs with i + rotary_dim / 2 (Llama and most others)
#   interleaved: dimension 2i pairs with 2i + 1 (GPT-J style)
# Partial rotary (GPT-NeoX, Phi, StableLM) is read from the model's inverse frequencies.
SUPPORTED_MODEL_TYPES: dict[str, RotaryLayout] = {
    "llama": "rotate_half",
    "mistral": "rotate_half",
    "mixtral": "rotate_half",
    "qwen2": "rotate_half",
    "qwen3": "rotate_half",
    "gemma": "rotate_half",
    "gemma2": "rotate_half",
    "gemma3_text": "rotate_half",
    "phi3": "rotate_half",
    "phi": "rotate_half",
    "gpt_neox": "rotate_half",
    "stablelm": "rotate_half",
    "starcoder2": "rotate_half",
    "olmo2": "rotate_half",
    "granite": "rotate_half",
    "cohere": "interleaved",
}

# Why some well-known types are refused, for a more useful message than "not verified".
_REFUSAL_REASONS = {
    "gpt2": "it uses learned absolute position embeddings, which cannot be re-assigned",
    "opt": "it uses learned absolute position embeddings, which cannot be re-assigned",
    "gpt_bigcode": "it uses learned absolute position embeddings, which cannot be re-assigned",
    "gptj": "its rotary table stops at max_position_embeddings",
    "codegen": "its rotary table stops at max_position_embeddings",
    "bloom": "ALiBi biases depend on where keys sit in the cache",
    "mpt": "ALiBi biases depend on where keys sit in the cache",
}

# Rotary types whose frequencies stay fixed whatever the position. "dynamic" and
# "longrope" rescale with the sequence length, so stored keys would disagree with new ones.
SUPPORTED_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def supported_list() -> str:
    return ", ".join(sorted(SUPPORTED_MODEL_TYPES))


def ensure_supported(config: Any) -> RotaryLayout:
    """Refuse configs the sink cache cannot serve exactly; return the rotary layout otherwise."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = getattr(text_config, "model_type", None) or "unknown"
    layout = SUPPORTED_MODEL_TYPES.get(model_type)
    if layout is None:
        reason = _REFUSAL_REASONS.get(model_type, "it has not been verified with the sink cache")
        raise UnsupportedModelError(
            f"model type '{model_type}' cannot stream: {reason}. Supported model types: {supported_list()}."
        )
    for rope_type in _rope_types(text_config):
        if rope_type not in SUPPORTED_ROPE_TYPES:
            supported = ", ".join(sorted(SUPPORTED_ROPE_TYPES))
            raise UnsupportedModelError(
                f"model type '{model_type}' uses rope scaling '{rope_type}', which rescales with the "
                f"sequence length and cannot stream; supported rope types: {supported}."
            )
    return layout


def _rope_types(text_config: Any) -> list[str]:
    parameters = getattr(text_config, "rope_parameters", None) or {}
    # Models with per-layer-type rotary settings (Gemma 3) nest one dict per layer type.
    nested = [value for value in parameters.values() if isinstance(value, dict)]
    groups = nested or [parameters]
    return [group.get("rope_type", "default") for group in groups]


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
    from transformers.cache_utils import get_layer_types_and_kwargs  # imports torch: only for a model

    layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
    rotary = _rotary_module(model)
    specs = []
    for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True):
        if layer_type not in ("full_attention", "sliding_attention"):
            raise UnsupportedModelError(
                f"model type '{config.model_type}' has '{layer_type}' layers, which cannot stream"
            )
        inv_freq: torch.Tensor | None = getattr(rotary, f"{layer_type}_inv_freq", None)
        if inv_freq is None:
            inv_freq = cast("torch.Tensor", rotary.inv_freq)  # a buffer: torch types module attributes Tensor | Module
        specs.append(LayerSpec(inv_freq, layout, kwargs.get("sliding_window"), layer_type))
    return specs


def keeps_own_window(spec: LayerSpec, window: int) -> bool:
    """Whether a layer keeps the model's sliding window in a cache of `window` recent tokens."""
    # A sliding window no wider than ours is kept as trained. A wider one never binds
    # inside our cache, so such a layer streams with sinks like a full-attention layer.
    return spec.sliding_window is not None and spec.sliding_window <= window


def _rotary_module(model: Any) -> torch.nn.Module:
    for name, module in model.named_modules():
        if name.endswith("rotary_emb"):
            return cast("torch.nn.Module", module)  # the model is untyped (Any); named_modules gives modules
    raise UnsupportedModelError(f"model type '{model.config.model_type}' has no rotary embedding module")
