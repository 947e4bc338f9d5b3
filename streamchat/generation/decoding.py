"""A reply as it is decoded: its text as it grows (Reply), and its tokens in the engine's steps, a token a step
(DecodingReply: what the token loop submits; a benchmark's EndlessReply).

    reply = Reply(tokenizer, settings, started, prefilled)   # its tokens, its text cut at a stop string, its timing
    decoding = DecodingReply(decoder, reply, stop_ids, stop_requested, evicted)
    # a request (engine/work.py): each step draws its token (next_work), feeds it, and settles it (advance)
    next_token = endless_reply(model, decoder)   # a benchmark's: each call, the next token of an endless reply

A decoding reply is the engine's to step (streamchat.engine): at the start of each step it
draws its token from its own logits, with its own settings and seeded sampler (its
Decoder; on a GPU the host reads the token back once the step that feeds it is queued);
at the end it reads the logits the step gave, detokenizes the token and checks it for a
stop. What it says (its text, an eviction, the cache's occupancy) comes back from the step
as its Output's events, for the process's driver to hand on (streamchat.generation.driver).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streamchat.cache import SinkCache
from streamchat.cache.ledger import Eviction
from streamchat.engine.engine import Engine
from streamchat.engine.work import Advanced, DecodeRow, Fed, PromptChunk, Work
from streamchat.generation.decoder import Decoder, Drawn
from streamchat.generation.detokenize import IncrementalDetokenizer
from streamchat.generation.events import (
    CacheOccupancy,
    Event,
    Evicted,
    StopReason,
    TextDelta,
    TokenLogprob,
    TurnStats,
)
from streamchat.generation.settings import GenerationSettings


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
