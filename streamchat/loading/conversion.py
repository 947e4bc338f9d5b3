"""A GGUF file's config and tokenizer, written once as the small files of a transformers model directory.

transformers rebuilds a GGUF's tokenizer from its metadata, which takes seconds for a large
vocabulary; the entry written here (config, generation config, tokenizer, chat template: a
few megabytes, no weights) loads at once. The weights are read from the GGUF itself at every
start, a tensor at a time (weights/gguf_source.py), or from their packed copy (packed_dir()).

Layout under cache_root():

    converted/<file stem>-<hash of its absolute path>/<size>-<mtime_ns>-transformers-<version>-<ENTRY_FORMAT>/
    packed/...   the packed copies (weights/packed_copy.py)

The entry is named after the source file's fingerprint, so a file that is replaced or
edited (new size or modification time) gets a new entry, and so does a new transformers
release, whose GGUF converter may have changed. A content hash would also notice a rewrite
that keeps size and mtime, but it would read the whole file on every start to guard against
something no download or editor does.

Entries of an older ENTRY_FORMAT (up to 0.1.0: a whole float32 copy of the weights) are never
read, and the first conversion of the same file sweeps them away.

An entry appears complete or not at all: it is written into a temporary sibling directory
and renamed into place, which is atomic on one file system.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import platformdirs

from streamchat import defaults
from streamchat.errors import ConfigError, StreamchatError
from streamchat.loading.configs import read_supported_config
from streamchat.loading.failures import model_errors
from streamchat.loading.integrity import ensure_complete_gguf

Notify = Callable[[str], None]

_PARTIAL_PREFIX = ".partial-"
# What an entry holds: "meta", the config and tokenizer only (older entries held float32 weights).
ENTRY_FORMAT = "meta"
# A partial entry untouched for this long belongs to a conversion that was killed outright.
_ABANDONED_AFTER_S = 24 * 3600


def cache_root() -> Path:
    """streamchat's cache directory: $STREAMCHAT_CACHE_DIR, else the platform's user cache."""
    override = os.environ.get(defaults.CACHE_DIR_ENV)
    return Path(override).expanduser() if override else Path(platformdirs.user_cache_dir(defaults.APP_NAME))


def kernels_dir() -> Path:
    """Where the product kernels streamchat builds for this machine live (placement/native.py)."""
    return cache_root() / "kernels"


def packed_dir() -> Path:
    """Where the packed copies of quantized models live (weights/packed_copy.py)."""
    return cache_root() / "packed"


def cached_model_bytes() -> dict[str, int]:
    """What streamchat's cache holds for models, in bytes: GGUF tokenizers and configs ("converted") and packed
    weights ("packed"), where there are any."""
    held = {name: _bytes_under(cache_root() / name) for name in ("converted", "packed")}
    return {name: size for name, size in held.items() if size}


def _bytes_under(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file()) if folder.is_dir() else 0


def conversion_dir(gguf: Path) -> Path:
    """Where the converted copy of `gguf` lives; it exists once a conversion has finished."""
    source = gguf.resolve()
    stat = source.stat()
    path_digest = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    transformers = importlib.metadata.version("transformers")
    fingerprint = f"{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers}-{ENTRY_FORMAT}"
    return cache_root() / "converted" / f"{source.stem}-{path_digest}" / fingerprint


def convert_gguf(gguf: Path, name: str, notify: Notify) -> Path:
    """The converted model directory for `gguf`, converting it first unless an earlier run did."""
    entry = conversion_dir(gguf)
    if entry.is_dir():
        return entry
    # Refuse damaged files and unsupported architectures before spending the conversion time on them.
    ensure_complete_gguf(gguf)
    read_supported_config(gguf.parent, name, gguf_file=gguf.name)
    partial = _make_partial(entry)
    try:
        notify(f"Reading {gguf.name}'s tokenizer and config once, into {entry.parent}.")
        _write_conversion(gguf, name, partial)
        _publish(partial, entry)
    finally:
        # After a successful publish the partial directory is gone; otherwise this removes
        # what an error or Ctrl-C left behind.
        shutil.rmtree(partial, ignore_errors=True)
    _sweep_siblings(entry)
    return entry


def _make_partial(entry: Path) -> Path:
    """A new temporary directory beside `entry`, to write the conversion into."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=_PARTIAL_PREFIX, dir=entry.parent))
    except OSError as error:
        raise ConfigError(
            f"cannot create {entry.parent} in streamchat's cache: {error.strerror or error}; "
            f"set {defaults.CACHE_DIR_ENV} to a writable directory"
        ) from error


def _write_conversion(gguf: Path, name: str, destination: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    with model_errors(name):
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    try:
        config.save_pretrained(destination)
        GenerationConfig.from_model_config(config).save_pretrained(destination)
        tokenizer.save_pretrained(destination)
    except OSError as error:
        raise StreamchatError(
            f"cannot write {gguf.name}'s tokenizer and config to {destination.parent}: {error.strerror or error}; "
            f"free some space or point {defaults.CACHE_DIR_ENV} elsewhere"
        ) from error


def _publish(partial: Path, entry: Path) -> None:
    try:
        partial.rename(entry)
    except OSError:
        # Another streamchat finished converting the same file first: keep its copy.
        if not entry.is_dir():
            raise


def _sweep_siblings(entry: Path) -> None:
    """Remove entries for older versions of the same file, and partials of killed conversions."""
    for sibling in entry.parent.iterdir():
        running = sibling.name.startswith(_PARTIAL_PREFIX) and _age_s(sibling) < _ABANDONED_AFTER_S
        if sibling != entry and not running:
            shutil.rmtree(sibling, ignore_errors=True)


def _age_s(path: Path) -> float:
    return time.time() - path.stat().st_mtime


def use_compile_cache() -> None:
    """Keep torch.compile's generated code in streamchat's cache dir, so the next start skips compiling.

    TorchInductor caches by default under /tmp, which a reboot empties; $TORCHINDUCTOR_CACHE_DIR wins.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_root() / "inductor"))
