"""The sink-preserving rolling KV cache (StreamingLLM) for transformers 5.

Names are imported on first use, so `streamchat.cache.ledger` (pure Python) can be
used without loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamchat.cache.feeding import Forwarded, forward
    from streamchat.cache.layers import LayerSpec, layer_specs
    from streamchat.cache.ledger import CacheStats, Eviction
    from streamchat.cache.sink_cache import SinkCache, Step, StepInputs

_HOMES = {
    "CacheStats": "ledger",
    "Eviction": "ledger",
    "Forwarded": "feeding",
    "forward": "feeding",
    "LayerSpec": "layers",
    "SinkCache": "sink_cache",
    "Step": "sink_cache",
    "StepInputs": "sink_cache",
    "layer_specs": "layers",
}

__all__ = [
    "CacheStats",
    "Eviction",
    "Forwarded",
    "LayerSpec",
    "SinkCache",
    "Step",
    "StepInputs",
    "forward",
    "layer_specs",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
