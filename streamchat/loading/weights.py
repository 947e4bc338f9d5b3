"""Which weight files streamchat loads: safetensors always, pickled checkpoints only on request.

Pickled `.bin` checkpoints can run arbitrary code while they are unpickled, so they are
loaded only with `--allow-pickle`. The same patterns decide what is downloaded from the
hub, so a refused format is never fetched.
"""

from __future__ import annotations

from pathlib import Path

from streamchat.errors import ModelAccessError

SAFETENSORS_WEIGHTS = "model*.safetensors"
PICKLED_WEIGHTS = "pytorch_model*.bin"


def weight_patterns(*, allow_pickle: bool) -> list[str]:
    """Glob patterns for the weight files streamchat may load."""
    return [SAFETENSORS_WEIGHTS, PICKLED_WEIGHTS] if allow_pickle else [SAFETENSORS_WEIGHTS]


def has_loadable_weights(directory: Path, *, allow_pickle: bool) -> bool:
    return any(any(directory.glob(pattern)) for pattern in weight_patterns(allow_pickle=allow_pickle))


def ensure_loadable_weights(directory: Path, name: str, *, allow_pickle: bool) -> None:
    """Refuse a model directory without weights streamchat is allowed to load."""
    if has_loadable_weights(directory, allow_pickle=allow_pickle):
        return
    if allow_pickle:
        raise ModelAccessError(f"{name} has no weights: found neither model*.safetensors nor pytorch_model*.bin")
    raise ModelAccessError(
        f"{name} has no safetensors weights (model*.safetensors). If it ships pickled weights "
        "(pytorch_model*.bin) and you trust its publisher, pass --allow-pickle."
    )
