"""An allocation that fails while the model runs, as one line that says what to make smaller."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from streamchat.errors import OutOfMemoryError, is_out_of_memory


@contextmanager
def out_of_memory_reported(device: torch.device, doing: str) -> Iterator[None]:
    """Within the block, running out of memory on `device` while `doing` something is an OutOfMemoryError."""
    try:
        yield
    except (MemoryError, RuntimeError) as error:
        if not is_out_of_memory(error):
            raise
        raise OutOfMemoryError(
            f"out of memory on {device} while {doing}; "
            "try a smaller --window, --dtype bfloat16 or float16, or a smaller model"
        ) from error
