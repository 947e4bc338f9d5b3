"""What `streamchat models`, `sessions` and `info` print: a table for people, records for --json."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table
from rich.text import Text

from streamchat.interface.safe_text import safe_text
from streamchat.interface.status import first_words
from streamchat.loading.catalog import CatalogEntry
from streamchat.loading.loader import LoadedModel
from streamchat.loading.resolve import ModelSource
from streamchat.storage.session_file import SessionSummary

# Characters of a session's first message that the sessions table shows.
FIRST_MESSAGE_PREVIEW = 60


def models_table(entries: list[CatalogEntry]) -> Table:
    table = Table(box=None, pad_edge=False)
    table.add_column("alias", no_wrap=True)
    # Folded, not cut: a path or hub id is useless with its end replaced by an ellipsis.
    table.add_column("resolves to", overflow="fold")
    table.add_column("offline")
    for entry in entries:
        alias = Text.assemble(entry.alias, (" (default)", "dim")) if entry.is_default else Text(entry.alias)
        table.add_row(alias, safe_text(entry.source.location), _availability(entry))
    return table


def catalog_record(entry: CatalogEntry) -> dict[str, object]:
    return {
        "alias": entry.alias,
        "kind": entry.source.kind,
        "resolves_to": entry.source.location,
        "default": entry.is_default,
        "offline": entry.offline,
        "needs_conversion": entry.needs_conversion,
    }


def cache_note(root: Path, held: dict[str, int]) -> Text | None:
    """Where streamchat keeps what it made of the models, and that deleting it is safe; None when it holds none."""
    if not held:
        return None
    what = {"packed": "packed weights", "converted": "GGUF tokenizers and configs"}
    parts = ", ".join(f"{_size(size)} of {what[name]}" for name, size in sorted(held.items(), reverse=True))
    return Text(f"streamchat's cache {root} holds {parts}; deleting it is safe: the next start makes them again")


def _size(count: int) -> str:
    return f"{count / 1e9:.1f} GB" if count >= 1e8 else f"{count / 1e6:.1f} MB"


def sessions_table(summaries: list[SessionSummary]) -> Table:
    table = Table(box=None, pad_edge=False)
    for header in ("when", "model", "turns", "first message", "file"):
        table.add_column(header, no_wrap=True, justify="right" if header == "turns" else "left")
    for summary in summaries:
        table.add_row(
            f"{summary.updated:%Y-%m-%d %H:%M}",
            safe_text(summary.model or "?"),
            f"{summary.turns:,}",
            safe_text(_preview(summary.first_message or "")),
            safe_text(str(summary.path)),
        )
    return table


def session_record(summary: SessionSummary) -> dict[str, object]:
    return {
        "path": str(summary.path),
        "updated": summary.updated.isoformat(timespec="seconds"),
        "model": summary.model,
        "turns": summary.turns,
        "first_message": summary.first_message,
    }


def _preview(message: str) -> str:
    """The message on one line, cut at a word near FIRST_MESSAGE_PREVIEW characters (a preview, not a column cut)."""
    line = " ".join(message.split())
    shown = first_words(line, FIRST_MESSAGE_PREVIEW)
    return shown + ("…" if len(shown) < len(line) else "")


def _availability(entry: CatalogEntry) -> str:
    if entry.source.kind == "gguf":
        return (
            "yes, packaged GGUF (reads its tokenizer once on first use)"
            if entry.needs_conversion
            else "yes, packaged GGUF"
        )
    return "yes, in the Hugging Face cache" if entry.offline else "no"


def model_summary(loaded: LoadedModel, window: int) -> Table:
    """What `streamchat info` prints about a loaded model, its caches at a window of `window` tokens."""
    rows = {
        "model": loaded.source.name,
        "source": _describe_source(loaded.source),
        "model type": loaded.model_type,
        "parameters": _count(loaded.parameters),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quantization": _describe_quantization(loaded),
        "max context": f"{loaded.max_context:,} tokens" if loaded.max_context else "not stated",
        "chat template": "yes" if loaded.has_chat_template else "no",
        "load time": f"{loaded.load_seconds:.1f} s",
    }
    if loaded.source.kind != "directory":
        rows["files"] = str(loaded.directory)
    if loaded.packed_copy is not None:
        rows["packed copy"] = str(loaded.packed_copy)
    rows["KV cache"] = _describe_kv_cache(loaded, window)
    # Which CPU kernels run the step: streamchat's own and the variant built for this CPU, else torch's.
    rows["kernels"] = "torch's" if loaded.native is None else f"streamchat's own, {loaded.native.variant}"
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows.items():
        table.add_row(key, safe_text(value))
    return table


def _describe_quantization(loaded: LoadedModel) -> str:
    if loaded.quantization == "none":
        return "none"
    how = "read from the packed copy" if loaded.weights_from == "packed copy" else "quantized"
    return f"{loaded.quantization} weights ({how} in {loaded.quantize_seconds:.2f} s)"


def _describe_kv_cache(loaded: LoadedModel, window: int) -> str:
    from streamchat.cache.quantized_kv import kv_format_of, model_token_bytes  # imports torch: `--version` does not

    kv_format = kv_format_of(loaded.model)
    per_token = model_token_bytes(loaded.model, kv_format)
    at_window = f"{per_token * window / 2**20:,.1f} MiB a conversation at a window of {window:,}"
    return f"{kv_format}: {per_token / 1024:,.1f} KiB a token, {at_window} (--kv-cache, --window)"


def _describe_source(source: ModelSource) -> str:
    if source.kind == "gguf":
        return f"GGUF file {source.location}"
    if source.kind == "hub":
        return f"Hugging Face hub {source.location}"
    return f"directory {source.location}"


def _count(parameters: int) -> str:
    if parameters >= 1_000_000_000:
        return f"{parameters / 1e9:.2f}B"
    if parameters >= 1_000_000:
        return f"{parameters / 1e6:.1f}M"
    return f"{parameters:,}"
