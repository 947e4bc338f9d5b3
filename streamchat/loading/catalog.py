"""The alias table with what each alias resolves to here, and whether it loads without the network."""

from __future__ import annotations

from dataclasses import dataclass

from streamchat import defaults
from streamchat.loading.aliases import ALIASES
from streamchat.loading.conversion import conversion_dir
from streamchat.loading.hub import is_cached
from streamchat.loading.resolve import ModelSource, resolve_model


@dataclass(frozen=True)
class CatalogEntry:
    alias: str
    source: ModelSource
    # Loads without the network: a packaged GGUF, or a complete copy in the Hugging Face cache.
    offline: bool
    # A GGUF source whose one-time conversion has not happened yet.
    needs_conversion: bool
    is_default: bool


def model_catalog() -> list[CatalogEntry]:
    """Every alias, in table order. Looks only at the disk: never downloads, never imports torch."""
    entries = []
    for alias in ALIASES:
        source = resolve_model(alias)
        is_gguf = source.kind == "gguf"
        entries.append(
            CatalogEntry(
                alias=alias,
                source=source,
                offline=is_gguf or is_cached(source.location),
                needs_conversion=is_gguf and not conversion_dir(source.path).is_dir(),
                is_default=alias == defaults.DEFAULT_MODEL,
            )
        )
    return entries
