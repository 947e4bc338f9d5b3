"""The sink-preserving rolling KV cache (StreamingLLM) for transformers 5.

Names are imported on first use, so `streamchat.cache.ledger` (pure Python) can be
used without loading torch and transformers.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamchat.cache.architectures import LayerSpec, layer_specs
    from streamchat.cache.feeding import Forwarded, forward
    from streamchat.cache.ledger import CacheStats, Eviction
    from streamchat.cache.sink_cache import ForwardPass, PassInputs, SinkCache

_HOMES = {
    "CacheStats": "ledger",
    "Eviction": "ledger",
    "ForwardPass": "sink_cache",
    "Forwarded": "feeding",
    "forward": "feeding",
    "LayerSpec": "architectures",
    "PassInputs": "sink_cache",
    "SinkCache": "sink_cache",
    "layer_specs": "architectures",
}

__all__ = [
    "CacheStats",
    "Eviction",
    "ForwardPass",
    "Forwarded",
    "LayerSpec",
    "PassInputs",
    "SinkCache",
    "forward",
    "layer_specs",
]


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOMES[name]}"), name)
