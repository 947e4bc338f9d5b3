"""Which tokens of a long text the cache reads, how far a long read has come, and the read itself.

The cache holds the sinks and one window. A text longer than that (a replayed
conversation, a pasted log) is read from its start only up to the sinks, and from its
end over the last REPLAYED_WINDOWS windows: the tokens that stay in the window are then
computed with a full window before them, as when they streamed. The middle would be
evicted again before the model could answer, so skipping it changes what the model
sees only by what the first of those windows was computed after.

    reading = Reading(cache, [(head, skipped), (tail, 0)], label, chunk, evicted, progress=progress)
    # in an engine's steps (engine/work.py: Request): next_work() -> fed -> advance(fed) -> what it says ...
    reading.logits                           # the logits after its last token
    logits = read_prompt(model, cache, ids)  # a benchmark's prompt, read whole as the chat reads one
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

import torch

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.engine.engine import Engine
from streamchat.engine.work import Advanced, Fed, PromptChunk
from streamchat.errors import CacheStateError, ConfigError
from streamchat.generation.events import CacheOccupancy, Event, Evicted, PromptProgress

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

    def __init__(self, total: int, chunk: int, reading: Literal["message", "conversation"] = "message") -> None:
        self.total = total
        self.chunk = chunk  # tokens per forward pass
        self.reading = reading
        self.read = 0
        self.started = time.perf_counter()

    def advance(self, count: int) -> PromptProgress | None:
        """Count `count` more tokens read; a progress event when the read takes more than one pass."""
        self.read += count
        if self.total <= self.chunk:
            return None
        elapsed = time.perf_counter() - self.started
        return PromptProgress(self.read, self.total, self.read / elapsed if elapsed > 0 else 0.0, self.reading)


class Reading:
    """Tokens read into a cache a chunk of `chunk` tokens per forward pass (engine/work.py: Request), in `parts`:
    each part's tokens, then how many tokens after them are skipped (counted as forgotten). After each chunk,
    its eviction and, with a `progress`, how far the read has come (with `occupancy`, the cache's too). With
    `stop_requested`, a stop asked for is heeded before a chunk once there are logits to answer from (`logits`,
    given: those of the tokens read before)."""

    def __init__(
        self,
        cache: SinkCache,
        parts: list[tuple[list[int], int]],
        label: int,
        chunk: int,
        evicted: Callable[[Eviction], Evicted],
        *,
        progress: ReadingProgress | None = None,
        occupancy: bool = False,
        stop_requested: Callable[[], bool] | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        self.cache, self.label = cache, label
        self.tokens = sum(len(ids) for ids, _ in parts)  # to read, all told
        self.logits = logits  # [1, 1, vocab] after the last token read; None until one is
        self.stopped = False  # a stop ended it before its last chunk
        self.error: BaseException | None = None  # what ended it, where a failure did
        # What is left to do, in order: chunks to read (lists of ids) and counts of tokens skipped (ints).
        self._left: list[list[int] | int] = []
        for ids, skipped in parts:
            self._left += [ids[start : start + chunk] for start in range(0, len(ids), chunk)]
            self._left.append(skipped)
        self._chunks_left = len(self._left) - len(parts)
        self._evicted, self._progress, self._occupancy = evicted, progress, occupancy
        self._stop_requested = stop_requested
        self._reading = 0  # the tokens of the chunk being read

    def next_work(self) -> PromptChunk | None:
        """The next chunk (the skips before it counted); None when there is none, or a stop was asked for."""
        self._count_skipped()
        if not self._chunks_left:
            return None
        if self.logits is not None and self._stop_requested is not None and self._stop_requested():
            self.stopped = True
            return None
        chunk = self._left.pop(0)
        if isinstance(chunk, int):  # _count_skipped() took every count before it
            raise CacheStateError("a reading's next chunk is a count of skipped tokens")
        self._chunks_left -= 1
        self._reading = len(chunk)
        return PromptChunk(self.cache, torch.tensor([chunk], device=self.cache.device), self.label)

    def advance(self, fed: Fed) -> Advanced:
        """A chunk was read: its logits kept, its eviction and progress said; it goes on while chunks are left."""
        self.logits = fed.logits
        events: list[Event] = []
        if fed.eviction is not None:
            events.append(self._evicted(fed.eviction))
        if self._progress is not None and (event := self._progress.advance(self._reading)) is not None:
            events.append(event)
            if self._occupancy:
                events.append(CacheOccupancy(self.cache.stats(), 0.0))
        return Advanced(tuple(events), self._chunks_left > 0)

    def end(self, error: BaseException | None) -> None:
        if error is None and not self.stopped:
            self._count_skipped()  # those after the last chunk
        self.error = error

    def _count_skipped(self) -> None:
        while self._left and isinstance(skipped := self._left[0], int):
            self._left.pop(0)
            self.cache.count_skipped(skipped, self.label)


def read_prompt(model: Any, cache: SinkCache, ids: list[int]) -> torch.Tensor:
    """Read `ids` whole into `cache` as the chat reads a text (TokenLoop.feed): a Reading, a chunk of at most
    defaults.PREFILL_CHUNK tokens (and the window) a step, in an engine of the benchmark's (engine/runner.py: the lean
    ragged pass where the model has one). For a benchmark's prompt, so that what it measures after the prompt
    starts from the cache the chat would hold (the benchmark is the process's driver: it takes the steps' outputs
    itself). The logits [1, 1, vocab] after the last token."""
    if not ids:
        raise ConfigError("a prompt to read needs at least one token")
    engine = Engine(model)
    reading = Reading(cache, [(ids, 0)], NO_LABEL, min(defaults.PREFILL_CHUNK, cache.window), _untold)
    engine.submit(reading)
    while not any(output.ended for output in engine.step()):
        pass
    if reading.error is not None:
        raise reading.error
    if reading.logits is None:  # it read at least one chunk
        raise CacheStateError("a prompt was read without logits after it")
    return reading.logits


def _untold(eviction: Eviction) -> Evicted:
    """An eviction's event without its text: a benchmark may have no tokenizer (random weights), nor anyone
    reading its events."""
    return Evicted(eviction.count, eviction.first_index, eviction.last_index, "", eviction.stats)
