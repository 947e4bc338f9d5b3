"""Which model types the sink cache supports, and how each lays out its rotary dimensions.

A model type is listed only once the exactness test against the naive reference
(tests/cache/test_against_reference.py) passes for it. Everything else is refused
with a message naming the model type and this list.
"""

from __future__ import annotations

from typing import Any, Literal

from streamchat.errors import UnsupportedModelError

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
