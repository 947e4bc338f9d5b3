"""An allocation that fails while the model runs, as one line that says what to make smaller."""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from streamchat.errors import out_of_memory_as


def out_of_memory_reported(device: torch.device, doing: str) -> AbstractContextManager[None]:
    """Within the block, running out of memory on `device` while `doing` something is an OutOfMemoryError."""
    return out_of_memory_as(
        f"out of memory on {device} while {doing}; try a smaller --window, --dtype bfloat16 or float16, "
        "or a smaller model"
    )
