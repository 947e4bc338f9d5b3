"""A turn's requests to the engine: its prompt read (Reading), its reply decoded (DecodingReply).

Each is an engine request (engine/work.py): each step asks it for its work (next_work), runs
it, and hands back what was fed (advance), which settles it and says what it says: an
eviction, how far a read has come, the reply's text. The engine's outputs carry those events
to the process's driver (streamchat.generation.driver).

Reading. The cache holds the sinks and one window. A text longer than that (a replayed
conversation, a pasted log) is read from its start only up to the sinks, and from its end
over the last REPLAYED_WINDOWS windows: the tokens that stay in the window are then computed
with a full window before them, as when they streamed. The middle would be evicted again
before the model could answer, so skipping it changes what the model sees only by what the
first of those windows was computed after.

Decoding. At the start of each step a reply draws its token from its own logits, with its
own settings and seeded sampler (its Decoder; on a GPU the host reads the token back once
the step that feeds it is queued); at the end it reads the logits the step gave,
detokenizes the token and checks it for a stop.

    reading = Reading(cache, [(head, skipped), (tail, 0)], label, chunk, evicted, progress=progress)
    reading.logits                           # the logits after its last token
    logits = read_prompt(model, cache, ids)  # a benchmark's prompt, read whole as the chat reads one
    reply = Reply(tokenizer, settings, started, prefilled)   # its tokens, its text cut at a stop string, its timing
    decoding = DecodingReply(decoder, reply, stop_ids, stop_requested, evicted)
    next_token = endless_reply(model, decoder)   # a benchmark's: each call, the next token of an endless reply
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.engine.engine import Engine
from streamchat.engine.work import Advanced, DecodeRow, Fed, PromptChunk, Work
from streamchat.errors import CacheStateError, ConfigError
from streamchat.generation.decoder import Decoder, Drawn
from streamchat.generation.detokenize import IncrementalDetokenizer
from streamchat.generation.events import (
    CacheOccupancy,
    Event,
    Evicted,
    PromptProgress,
    StopReason,
    TextDelta,
    TokenLogprob,
    TurnStats,
)
from streamchat.generation.settings import GenerationSettings

# ---- reading a prompt --------------------------------------------------------------------------

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
    defaults.PREFILL_CHUNK tokens (and the window) a step, in an engine of the benchmark's (its Runner: the lean
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


# ---- decoding a reply --------------------------------------------------------------------------


class Reply:
    """One reply as it grows: its tokens, its text (cut at a stop string), its timing."""

    def __init__(self, tokenizer: Any, settings: GenerationSettings, started: float, prefilled: float) -> None:
        self.settings = settings
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self.text = ""  # what has been shown
        self._held = ""  # text that may be the start of a stop string
        self.reason: StopReason = "max_new_tokens"
        self.stop_string: str | None = None  # the one that ended it, where one did
        self.started = started  # when the turn began
        self.prefilled = prefilled  # when its prompt was in the cache
        self.first_token_at: float | None = None

    def add(self, token: int) -> str:
        """Take a sampled token; return the text it shows (none past a stop string, none that may begin one)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids.append(token)
        return self._show(self.detokenizer.push(token))

    def flush(self) -> str:
        """The text still held back, at the end of the reply."""
        return "" if self.reason == "stop_string" else self._show(self.detokenizer.flush(), final=True)

    def decode_speed(self) -> float:
        elapsed = time.perf_counter() - (self.first_token_at or self.started)
        return (len(self.ids) - 1) / elapsed if elapsed > 0 else 0.0

    def stats(self, prompt_tokens: int, copied: int = 0) -> TurnStats:
        now = time.perf_counter()
        first = self.first_token_at or now
        return TurnStats(
            prompt_tokens=prompt_tokens,
            generated_tokens=len(self.ids),
            prefill_seconds=self.prefilled - self.started,
            decode_seconds=now - first,
            time_to_first_token=first - self.started,
            stop_reason=self.reason,
            copied_prompt_tokens=copied,
            stop_string=self.stop_string,
        )

    def _show(self, delta: str, final: bool = False) -> str:
        stops = self.settings.stop
        if not stops:
            self.text += delta
            return delta
        pending = self._held + delta
        hits = [(index, stop) for stop in stops if (index := pending.find(stop)) != -1]
        if hits:
            first, self.stop_string = min(hits, key=lambda hit: hit[0])  # the earliest; the first given of a tie
            self.reason = "stop_string"
            shown, self._held = pending[:first], ""
        else:
            # Text that may begin a stop string waits until the next tokens settle it: shown text
            # cannot be taken back.
            held = 0 if final else _stop_prefix_length(pending, stops)
            shown, self._held = pending[: len(pending) - held], pending[len(pending) - held :]
        self.text += shown
        return shown


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the beginning of a stop string."""
    longest = min(len(text), max(len(stop) for stop in stops) - 1)
    for length in range(longest, 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0


class DecodingReply:
    """A reply being decoded: what each token fed means for it (settle), and, in the engine's steps
    (engine/work.py: Request), its next token drawn and its step's outcome."""

    def __init__(
        self,
        decoder: Decoder,
        reply: Reply,
        stop_ids: frozenset[int],
        stop_requested: Callable[[], bool],
        evicted: Callable[[Eviction], Evicted],
        logprob: Callable[[int], TokenLogprob] | None = None,
    ) -> None:
        self.decoder, self.reply, self.stop_ids = decoder, reply, stop_ids
        self.cache: SinkCache = decoder.cache
        self.error: BaseException | None = None  # what ended it, where a failure did
        self.stop_requested = stop_requested  # the conversation's stop(), heeded before each draw
        self._evicted = evicted
        self._logprob = logprob  # each token's log-probabilities, where they were asked for

    def next_work(self) -> Work | None:
        """Its next token drawn (the leader's, under tensor parallelism), as work to feed; None on stop()."""
        drawn = self.decoder.draw_agreed(self.stop_requested())
        if drawn is None:
            self.reply.reason = "interrupted"
            return None
        return _token_work(self.decoder, drawn)

    def advance(self, fed: Fed) -> Advanced:
        """The step fed its token: the logits the next one is drawn from, and what the token means. A guess drawn
        again says nothing: its step never happened, the next feeds the token."""
        token = self.decoder.fed(fed.logits)
        return Advanced((), True) if token is None else self._settle(token, fed.eviction)

    def _settle(self, token: int, eviction: Eviction | None) -> Advanced:
        """`token` was fed (making room evicted `eviction`): its text and eviction said, or taken back where it
        ends the reply."""
        if token in self.stop_ids:  # fed as a guess; it ends the reply without belonging in the cache
            self.decoder.take_back()
            self.reply.reason = "eos"
            return Advanced((), False)
        events: list[Event] = [] if self._logprob is None else [self._logprob(token)]
        if delta := self.reply.add(token):
            events.append(TextDelta(delta))
        if eviction is not None:
            events.append(self._evicted(eviction))
        if self.reply.reason == "stop_string" or len(self.reply.ids) >= self.reply.settings.max_new_tokens:
            return Advanced(tuple(events), False)
        events.append(CacheOccupancy(self.cache.stats(), self.reply.decode_speed()))
        return Advanced(tuple(events), True)

    def end(self, error: BaseException | None) -> None:
        self.error = error


class EndlessReply:
    """A reply decoding in the engine that never ends and says nothing but its tokens: a benchmark's steps."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder, self.cache = decoder, decoder.cache

    def next_work(self) -> Work:
        return _token_work(self.decoder, self.decoder.draw())

    def advance(self, fed: Fed) -> Advanced:
        """Its token, settled and fed, and what feeding it evicted (nothing where its guess was drawn again)."""
        token = self.decoder.fed(fed.logits)
        return Advanced(() if token is None else (Decoded(token, fed.eviction),), True)

    def end(self, error: BaseException | None) -> None:
        pass  # it never ends but by a failure, which its step's output carries


@dataclass(frozen=True)
class Decoded:
    """A token drawn and fed, and what feeding it evicted."""

    token: int
    eviction: Eviction | None


def endless_reply(model: Any, decoder: Decoder, compile_backend: str | None = None) -> Callable[[], Decoded]:
    """Each call, the next token of `decoder`'s reply, decoding alone in an engine as the chat's does (its text
    aside; with `compile_backend`, its step compiled): for a benchmark to time, a test to read. The benchmark is
    the process's driver: it takes each step's output itself."""
    engine = Engine(model, compile_backend=compile_backend)
    engine.submit(EndlessReply(decoder))

    def next_token() -> Decoded:
        while True:  # a guess drawn again takes one more step
            for output in engine.step():
                if output.error is not None:
                    raise output.error
                for event in output.events:
                    if isinstance(event, Decoded):
                        return event

    return next_token


def _token_work(decoder: Decoder, drawn: Drawn) -> Work:
    """A token drawn, as work to feed: a decode row, or a chunk of one while the cache's sinks are not full yet (a
    decode row needs them full). Its decoder's checkpoint first: what take_back() returns to."""
    decoder.checkpoint()
    cache, label = decoder.cache, decoder.label
    if cache.ledger.sinks_full:
        return DecodeRow(cache, drawn.on_device, drawn.token_id, label)
    return PromptChunk(cache, drawn.on_device.reshape(1, 1), label)
