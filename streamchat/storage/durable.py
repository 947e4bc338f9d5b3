"""Files written whole, durably: a kill or a power cut leaves the old file or the new one, never a torn one.

    size = write_durably(path, lambda temporary: temporary.write_text(text))

The content goes to a temporary file beside `path` (mode 0600: conversations are
private), which is synced, renamed over `path`, and the directory synced, so the
rename itself survives a power cut. Every file streamchat writes whole goes through
here (session files, cache states, benchmark results); the journal, which is appended,
syncs each record itself.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path


def write_durably(path: Path, write: Callable[[Path], object]) -> int:
    """Have `write(temporary)` fill a temporary file, then put it at `path` atomically; its size in bytes.

    OSError when it cannot be written; the temporary file is gone then, and `path` untouched.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        with open(temporary, "rb") as written:
            os.fsync(written.fileno())
        os.replace(temporary, path)
    except BaseException:
        with suppress(OSError):
            temporary.unlink()
        raise
    sync_directory(path.parent)
    return path.stat().st_size


def sync_directory(directory: Path) -> None:
    """Make a file's creation or rename in `directory` durable (where the platform allows it)."""
    try:
        descriptor = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform (Windows); the file itself is synced
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
