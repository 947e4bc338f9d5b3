"""Tiny random-initialised models of every supported architecture, built offline from config classes."""

from __future__ import annotations

from functools import cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from streamchat.loading.loader import attention_implementation

VOCAB = 256

_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
    initializer_range=0.02,
)

# Per model type: what differs from _COMMON, chosen to exercise each rotary variant.
ARCHITECTURES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1},
    "qwen2": {},
    "qwen3": {"head_dim": 16},
    "gemma": {"head_dim": 16},
    # Gemma 2: alternating sliding (own window of 24, narrower than the test window) and full layers.
    "gemma2": {"head_dim": 16, "sliding_window": 24},
    # Gemma 3: different rope bases for sliding and full layers.
    "gemma3_text": {
        "head_dim": 16,
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "phi3": {"sliding_window": 2047},
    "phi": {"num_key_value_heads": 4},  # partial rotary (factor 0.5)
    "gpt_neox": {"num_key_value_heads": None, "rotary_pct": 0.25},  # partial rotary
    "stablelm": {},  # partial rotary (factor 0.25)
    "starcoder2": {},
    "olmo2": {},
    "granite": {},
    "cohere": {},  # interleaved pairs
}

# Rope scaling variants, applied on a llama config.
ROPE_SCALINGS: dict[str, dict] = {
    "linear": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 500000.0,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "rope_theta": 10000.0,
        "attention_factor": 1.3,
    },
}


def tiny_config(model_type: str, rope_scaling: str | None = None, **overrides):
    kwargs = {**_COMMON, **ARCHITECTURES[model_type], **overrides}
    kwargs = {key: value for key, value in kwargs.items() if value is not None or key == "sliding_window"}
    if rope_scaling is not None:
        kwargs["rope_parameters"] = dict(ROPE_SCALINGS[rope_scaling])
    return AutoConfig.for_model(model_type, **kwargs)


@cache
def _cached_model(model_type: str, rope_scaling: str | None, dtype: torch.dtype, seed: int, vocab_size: int):
    torch.manual_seed(seed)
    config = tiny_config(model_type, rope_scaling, vocab_size=vocab_size)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config))
    with torch.no_grad():
        # Trained models give a few likely tokens far larger logits than the rest. Random
        # ones give a Gaussian crowd, where a single bf16 rounding anywhere flips 1-2 % of
        # the argmaxes whatever the cache does. Log-normal output scales restore the shape.
        scales = torch.randn(config.vocab_size, 1, generator=torch.Generator().manual_seed(seed)).exp()
        model.get_output_embeddings().weight.mul_(scales)
    return model.to(dtype).eval()


def tiny_model(
    model_type: str = "llama",
    *,
    rope_scaling: str | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    vocab_size: int = VOCAB,
):
    """A tiny random model (cached: treat it as read-only)."""
    return _cached_model(model_type, rope_scaling, dtype, seed, vocab_size)
