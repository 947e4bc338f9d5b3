"""The sink-preserving rolling KV cache (StreamingLLM) for transformers 5."""

from streamchat.cache.ledger import CacheStats, Eviction
from streamchat.cache.prefill import prefill, prefill_chunks
from streamchat.cache.sink_cache import LayerSpec, SinkCache, layer_specs

__all__ = ["CacheStats", "Eviction", "LayerSpec", "SinkCache", "layer_specs", "prefill", "prefill_chunks"]
