"""Which tokens of a long text the cache reads, and how far a long read has come.

The cache holds the sinks and one window. A text longer than that (a replayed
conversation, a pasted log) is read from its start only up to the sinks, and from its
end over the last REPLAYED_WINDOWS windows: the tokens that stay in the window are then
computed with a full window before them, as when they streamed. The middle would be
evicted again before the model could answer, so skipping it changes what the model
sees only by what the first of those windows was computed after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Literal

from streamchat.generation.events import PromptProgress

# A replay, or a long prompt, feeds the last this-many windows of its text.
REPLAYED_WINDOWS = 2


def replayed_parts(ids: list[int], start: int, skip_from: int, skip_to: int) -> tuple[list[int], list[int]]:
    """The head and tail of `ids`, a text at stream position `start`, that a read skipping
    stream positions skip_from..skip_to feeds; all of `ids` when there is nothing to skip."""
    head = ids[: max(0, skip_from - start)] if skip_to > skip_from else ids
    tail = ids[len(head) :][max(0, skip_to - start - len(head)) :]
    return head, tail


def replayed_count(total: int, sinks: int, window: int) -> int:
    """How many tokens of a `total`-token replay are read: those `replayed_parts` gives, over all its messages."""
    return total - max(0, total - REPLAYED_WINDOWS * window - sinks)


def prompt_parts(ids: list[int], seen: int, sinks: int, window: int, read_all: bool) -> tuple[list[int], list[int]]:
    """The head and tail of a prompt to feed after `seen` tokens: the sinks not filled yet and
    the last REPLAYED_WINDOWS windows, as a replay reads a conversation; all of it with `read_all`."""
    if read_all:
        return ids, []
    return replayed_parts(ids, seen, sinks, seen + len(ids) - REPLAYED_WINDOWS * window)


class ReadingProgress:
    """How far a long read has come: tokens read of `total`, at what speed, how long is left."""

    def __init__(self, total: int, step: int, reading: Literal["message", "conversation"] = "message") -> None:
        self.total = total
        self.step = step  # tokens per forward pass
        self.reading = reading
        self.read = 0
        self.started = time.perf_counter()

    def pieces(self, ids: list[int]) -> Iterator[list[int]]:
        """`ids` in forward-pass-sized pieces, so that a read can stop or report between them."""
        for start in range(0, len(ids), self.step):
            yield ids[start : start + self.step]

    def advance(self, count: int) -> PromptProgress | None:
        """Count `count` more tokens read; a progress event when the read takes more than one pass."""
        self.read += count
        if self.total <= self.step:
            return None
        elapsed = time.perf_counter() - self.started
        return PromptProgress(self.read, self.total, self.read / elapsed if elapsed > 0 else 0.0, self.reading)
