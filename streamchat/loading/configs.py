"""Reading a model's config: the first file looked at, and the one that decides whether it can stream."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from streamchat.loading.failures import model_errors

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def read_supported_config(
    location: Path, name: str, *, trust_remote_code: bool = False, gguf_file: str | None = None
) -> PreTrainedConfig:
    """The config in `location` (a model directory, or the folder of `gguf_file`).

    Raises UnsupportedModelError for architectures the sink cache cannot serve, before any
    weights are read, converted or downloaded.
    """
    from transformers import AutoConfig

    # Imported here: the cache package brings torch and transformers with it.
    from streamchat.cache.architectures import ensure_supported

    with model_errors(name):
        config = AutoConfig.from_pretrained(location, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
    ensure_supported(config)
    return config
