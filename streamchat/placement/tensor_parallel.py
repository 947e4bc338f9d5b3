"""--tp: which models transformers can shard across ranks, and what loading them takes.

transformers shards a model whose config carries a `base_model_tp_plan` (which linear
layers split by rows, which by columns) with `tp_plan="auto"`, once torch.distributed's
default process group is up (streamchat.distributed.group). The rules here are pure.
"""

from __future__ import annotations

from functools import cache
from typing import Any

from streamchat.cache.architectures import SUPPORTED_MODEL_TYPES
from streamchat.errors import ConfigError, UnsupportedModelError


def has_tensor_parallel_plan(config: Any) -> bool:
    """Whether transformers knows how to shard a model with this config."""
    return bool(getattr(config.get_text_config(decoder=True), "base_model_tp_plan", None))


@cache
def tensor_parallel_model_types() -> tuple[str, ...]:
    """The model types streamchat supports that transformers can also shard (for messages and the README)."""
    from transformers import AutoConfig

    return tuple(
        model_type
        for model_type in sorted(SUPPORTED_MODEL_TYPES)
        if has_tensor_parallel_plan(_blank(AutoConfig, model_type))
    )


def _blank(auto_config: Any, model_type: str) -> Any:
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()  # blank configs warn about their default token ids
    try:
        return auto_config.for_model(model_type)
    finally:
        transformers_logging.set_verbosity(verbosity)


def ensure_tensor_parallel_plan(config: Any, name: str) -> None:
    """UnsupportedModelError, naming the model types that have a plan, when `config` has none."""
    if not has_tensor_parallel_plan(config):
        model_type = config.get_text_config(decoder=True).model_type
        raise UnsupportedModelError(
            f"{name} ({model_type}) has no tensor-parallel plan in transformers, so --tp cannot shard it; "
            f"model types with one: {', '.join(tensor_parallel_model_types())}"
        )


def tensor_parallel_quantization(quantize: str) -> str:
    """What --quantize means under --tp: auto is none; int8 and int4 are refused.

    The plan shards nn.Linear weights; streamchat's quantized layers replace them after loading.
    """
    if quantize in ("auto", "none"):
        return "none"
    raise ConfigError(f"--quantize {quantize} cannot be used with --tp (which shards unquantized weights); drop it")


def ensure_no_device_map(device_map: str | None) -> None:
    """--tp places one shard on each rank's device: --device-map would place the model a second way."""
    if device_map is not None:
        raise ConfigError(
            f"--tp and --device-map {device_map} both spread the model; give one of them "
            "(--device-map auto: fits a model on one machine's GPUs; --tp: speed, and several machines)"
        )


def ensure_heads_split(config: Any, tp_size: int, name: str) -> None:
    """ConfigError unless the attention and KV heads split evenly over `tp_size` ranks (each takes whole heads)."""
    text_config = config.get_text_config(decoder=True)
    heads = getattr(text_config, "num_attention_heads", None)
    if not heads:
        return
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    if heads % tp_size == 0 and kv_heads % tp_size == 0:
        return
    fits = [n for n in range(2, kv_heads + 1) if heads % n == 0 and kv_heads % n == 0]
    suggestion = f"use --tp {' or '.join(map(str, fits))}" if fits else "it cannot be sharded; drop --tp"
    raise ConfigError(
        f"--tp {tp_size}: {name} has {heads} attention heads and {kv_heads} KV heads, "
        f"which do not split evenly over {tp_size} processes; {suggestion}"
    )
