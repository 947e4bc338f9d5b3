"""TokenLoop: the tokens of a conversation through one sink cache, each fed exactly once, in order.

ChatSession decides what to say and keeps the transcript; the token loop does the work
per token, in the phases of a turn:

    prefill         read a prompt (only its head and tail when it is longer than the cache)
    decode          draw, show and feed reply tokens until a stop
    feed            any other tokens: the end of a turn, a replayed message

It owns the cache, hands every forward pass to an engine's steps (its own, or one shared
with other conversations: the server's), feeds every token labelled with its transcript
message (the cache records both: streamchat.cache.record, what views read), and turns
every eviction it makes into an Evicted event.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from streamchat.cache import SinkCache
from streamchat.cache.ledger import Eviction
from streamchat.cache.record import UNREAD
from streamchat.engine.engine import Engine
from streamchat.generation.decoder import Decoder, StepChannel
from streamchat.generation.engine_steps import DecodingReply, EngineSteps, Waiting
from streamchat.generation.events import (
    CacheOccupancy,
    Event,
    Evicted,
    PromptSkipped,
    PromptTruncated,
)
from streamchat.generation.out_of_memory import out_of_memory_reported
from streamchat.generation.prompt_reading import (
    REPLAYED_WINDOWS,
    Reading,
    ReadingProgress,
    prompt_parts,
    replayed_count,
    replayed_parts,
)
from streamchat.generation.reply import Reply
from streamchat.generation.sampling import Sampler


class Prefilled(NamedTuple):
    """A prompt read into the cache."""

    logits: torch.Tensor  # the last position's: the reply is drawn from them
    tokens: int  # how many were read (not a long prompt's middle, not past a stop())
    whole: bool  # every token meant to be read was: no stop() cut the reading short
    at: float  # time.perf_counter() when the last of them was in the cache
    copied: int = 0  # of `tokens`, the sinks copied in as another conversation read them (engine/shared_sinks.py)


class TokenLoop:
    """Feeds one conversation's tokens through a sink cache and draws its replies."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        window: int,
        prefill_chunk: int,
        compile_backend: str | None,
        channel: StepChannel | None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.window = window
        self.prefill_chunk = prefill_chunk
        # Under tensor parallelism: how the ranks agree on tokens and stops (streamchat.distributed).
        self.channel = channel
        self.device = model.get_input_embeddings().weight.device
        # Both come with use_sinks(): a cache's size depends on the chat format, known later.
        self.cache: SinkCache | None = None
        self.decoder: Decoder | None = None
        # Set from outside, a signal handler included: the loop heeds it between two forward passes.
        self.stop_requested = False
        # The engine whose steps take the forward passes: its own, which it drives, or one shared with other
        # conversations (the server's: run_in()).
        self.own_engine = EngineSteps(Engine(model, compile_backend=compile_backend), drives=True)
        self.engine = self.own_engine

    def use_sinks(self, sinks: int) -> None:
        """Keep `sinks` tokens from now on, in a new, empty cache."""
        self.cache = self.decoder = None  # the old storage goes before the new one is allocated
        self.cache = SinkCache.for_model(self.model, sinks, self.window)
        self.decoder = Decoder(self.cache, vocab_size=len(self.tokenizer), channel=self.channel)

    def reset(self) -> None:
        """Empty the cache, keeping its storage (and the decode step compiled for it, if any)."""
        self.cache.reset()

    def is_whole(self) -> bool:
        """Whether the cache holds whole steps of known tokens: no forward pass was torn off half way, and no
        reply token was fed that the host never read back (its reply abandoned in between)."""
        return self.cache.is_consistent() and UNREAD not in self.cache.held_tokens().token_ids

    @contextmanager
    def alone(self) -> Iterator[None]:
        """Within the block, forward passes run in its own engine's steps, at once (for events nobody drives)."""
        engine, self.engine = self.engine, self.own_engine
        try:
            yield
        finally:
            self.engine = engine

    def stop_agreed(self) -> bool:
        """stop() as every rank sees it: the leader's, under tensor parallelism."""
        if self.channel is None:
            return self.stop_requested
        return self.channel.agree_stop(self.stop_requested)

    # ---- the phases of a turn ---------------------------------------------------------------

    def prefill(
        self, prompt: list[int], message: int, read_all: bool, reply_room: int | None
    ) -> Generator[Event | Waiting, None, Prefilled]:
        """Read the prompt of transcript message `message`; a long one as a replay reads a
        conversation (streamchat.generation.prompt_reading) unless `read_all`. With `reply_room`,
        room is made at once for the prompt and that many reply tokens (the paper's per-turn policy)."""
        stats = self.cache.stats()
        head, tail = prompt_parts(prompt, stats.seen, self.cache.sinks, self.cache.window, read_all)
        wanted = len(head) + len(tail)
        if wanted < len(prompt):
            yield PromptSkipped(len(prompt), wanted, "too_long")
        if reply_room is not None:
            yield from self._make_room(min(wanted + reply_room, self.cache.window))
        before = self.cache.stats()
        logits, read, copied = yield from self._read_prompt(head, tail, len(prompt) - wanted, message)
        prefilled = time.perf_counter()
        # Evictions take the oldest window tokens first: past those, they took the prompt's own.
        dropped = self.cache.stats().evicted - before.evicted - before.window_used
        if read < wanted:
            yield PromptSkipped(len(prompt), read, "stopped")
        elif dropped > 0:
            yield PromptTruncated(prompt_tokens=len(prompt), visible_tokens=read - dropped)
        return Prefilled(logits, read, read == wanted, prefilled, copied)

    def decode(
        self, logits: torch.Tensor, reply: Reply, message: int, sampler: Sampler, stop_ids: frozenset[int]
    ) -> Generator[Event | Waiting, None, None]:
        """Draw, show and feed tokens one by one, until a stop token or string, the limit, or stop()."""
        self.decoder.start(logits, reply.settings, sampler, label=message)
        decoding = DecodingReply(self.decoder, reply, stop_ids, lambda: self.stop_requested, self._evicted)
        with out_of_memory_reported(self.device, "generating"):
            yield from self.engine.run(decoding)

    def feed(self, token_ids: list[int], message: int) -> Generator[Event | Waiting, None, torch.Tensor | None]:
        """Feed tokens in chunks, evicting what does not fit; return the last position's logits."""
        reading = self._reading([(token_ids, 0)], message)
        yield from self._read(reading)
        return reading.logits

    def replay_progress(self, total: int) -> ReadingProgress:
        """The progress of a replay `total` tokens long, over the tokens it reads (replay_message's)."""
        read = replayed_count(total, self.cache.sinks, self.cache.window)
        return ReadingProgress(read, self._chunk, "conversation")

    def replay_message(
        self, ids: list[int], start: int, total: int, message: int, progress: ReadingProgress
    ) -> Generator[Event | Waiting, None, int]:
        """Feed message `message`, at stream position `start` of a replay `total` tokens long: only what
        falls in the sinks or the last REPLAYED_WINDOWS windows, as the middle would only be evicted again.
        Each forward pass is followed by the replay's `progress` and the cache's occupancy. How many of its
        tokens were copied in rather than read (the first message's sinks, where another conversation read them)."""
        skip_to = total - REPLAYED_WINDOWS * self.cache.window
        head, tail = replayed_parts(ids, start, self.cache.sinks, skip_to)
        logits, shared = yield from self.share_sinks(head, message)
        if shared and (event := progress.advance(shared)) is not None:
            yield event
            yield CacheOccupancy(self.cache.stats(), 0.0)
        parts = [(head[shared:], len(ids) - len(head) - len(tail)), (tail, 0)]
        yield from self._read(self._reading(parts, message, progress=progress, occupancy=True))
        return shared if logits is None else 0

    # ---- helpers ---------------------------------------------------------------------------

    def _read_prompt(
        self, head: list[int], tail: list[int], skipped: int, message: int
    ) -> Generator[Event | Waiting, None, tuple[torch.Tensor, int, int]]:
        """Feed a prompt's head, count the `skipped` middle as forgotten, feed its tail; return
        (the last logits, tokens read, of them copied). Progress is reported, and stop() heeded, between passes."""
        progress = ReadingProgress(len(head) + len(tail), self._chunk)
        logits, shared = None, 0
        if len(head) + len(tail) > self.cache.sinks:  # more to read after the sinks: the logits come from it
            logits, shared = yield from self.share_sinks(head, message)
        copied = shared if logits is None else 0
        if shared and (event := progress.advance(shared)) is not None:
            yield event
        parts = [(head[shared:], skipped), (tail, 0)]
        reading = self._reading(parts, message, progress=progress, stop_requested=self.stop_agreed, logits=logits)
        yield from self._read(reading)
        return reading.logits, progress.read, copied

    def share_sinks(
        self, head: list[int], message: int
    ) -> Generator[Event | Waiting, None, tuple[torch.Tensor | None, int]]:
        """A new conversation's sinks, shared with the others over the engine that begin alike
        (engine/shared_sinks.py): copied in where one read them, else read in a pass of their own and kept.
        The logits after them (None when copied), and how many of the head's tokens they are (0: none shared)."""
        steps, sinks = self.engine, self.cache.sinks
        if steps.shared_sinks is None or self.cache.stats().seen or len(head) < sinks:
            return None, 0
        ids = head[:sinks]
        if (yield from steps.copy_sinks(self.cache, ids, message)):
            return None, sinks
        try:
            logits = yield from self.feed(ids, message)
        except BaseException:  # stopped, abandoned or failed half way: the next conversation reads them
            steps.shared_sinks.forget_reading(self.cache, ids, message)
            raise
        steps.shared_sinks.keep(self.cache, ids, message)
        return logits, sinks

    @property
    def _chunk(self) -> int:
        """The most tokens one forward pass reads."""
        return min(self.prefill_chunk, self.cache.window)

    def _reading(self, parts: list[tuple[list[int], int]], message: int, **options: Any) -> Reading:
        return Reading(self.cache, parts, message, self._chunk, self._evicted, **options)

    def _read(self, reading: Reading) -> Generator[Event | Waiting, None, None]:
        """Read `reading` through the cache, in the engine's steps."""
        with out_of_memory_reported(self.device, f"reading {reading.tokens:,} tokens"):
            # Yields while the steps run: outside inference mode, which is the thread's, as the driver (the
            # server's worker) runs other conversations between two items.
            yield from self.engine.run(reading)

    def _make_room(self, incoming: int) -> Generator[Event, None, None]:
        """Make room ahead for `incoming` tokens; report what that evicted."""
        eviction = self.cache.evict_for_space(incoming)
        if eviction is not None:
            yield self._evicted(eviction)

    def _evicted(self, eviction: Eviction) -> Evicted:
        """The event for an eviction the cache made, with the text of the tokens that left."""
        text = self.tokenizer.decode(list(eviction.token_ids), skip_special_tokens=False)
        return Evicted(eviction.count, eviction.first_index, eviction.last_index, text, eviction.stats)
