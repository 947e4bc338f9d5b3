"""What --model means, the GGUF conversion cache, and device and dtype choice.

The engine needs only `load_model(LoadOptions(...)) -> LoadedModel`.
"""

from streamchat.loading.loader import LoadedModel, LoadOptions, load_model

__all__ = ["LoadOptions", "LoadedModel", "load_model"]
