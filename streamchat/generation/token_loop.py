"""TokenLoop: the tokens of a conversation through one sink cache, each fed exactly once, in order.

ChatSession decides what to say and keeps the transcript; the token loop does the work
per token, in the phases of a turn:

    prefill         read a prompt (only its head and tail when it is longer than the cache)
    decode          draw, show and feed reply tokens until a stop
    feed            any other tokens: the end of a turn, a replayed message

It owns the cache, and yields every forward pass it needs as a request for the engine's
steps (engine/work.py: a reply to decode, a text to read), which the process's driver runs
with other conversations' (streamchat.generation.driver) and resumes it after. It feeds
every token labelled with its transcript message (the cache records both:
streamchat.cache.record, what views read), and turns every eviction it makes into an
Evicted event.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from contextlib import AbstractContextManager
from functools import partial
from typing import Any, NamedTuple

import torch

from streamchat.cache import SinkCache
from streamchat.cache.ledger import Eviction
from streamchat.cache.record import UNREAD
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.engine.work import Request
from streamchat.errors import CacheStateError, ConfigError, out_of_memory_as
from streamchat.generation.constraint import ReplyFormat
from streamchat.generation.decoder import Decoder, LockstepChannel
from streamchat.generation.events import (
    CacheOccupancy,
    Event,
    Evicted,
    PromptSkipped,
    PromptTruncated,
    TokenLogprob,
)
from streamchat.generation.requests import (
    REPLAYED_WINDOWS,
    DecodingReply,
    Reading,
    ReadingProgress,
    Reply,
    prompt_parts,
    replayed_count,
    replayed_parts,
)
from streamchat.generation.sampling import Sampler


class Prefilled(NamedTuple):
    """A prompt read into the cache."""

    logits: torch.Tensor  # the last position's: the reply is drawn from them
    tokens: int  # how many were read (not a long prompt's middle, not past a stop())
    whole: bool  # every token meant to be read was: no stop() cut the reading short
    at: float  # time.perf_counter() when the last of them was in the cache
    copied: int = 0  # of `tokens`, the sinks copied in as another conversation read them (engine/shared_sinks.py)


class RegenPoint(NamedTuple):
    """The cache right after a prompt, and the logits after it: /regen restores it and draws a new reply."""

    cache: CacheSnapshot
    logits: torch.Tensor

    @classmethod
    def take(cls, loop: TokenLoop, reach: int, logits: torch.Tensor) -> RegenPoint:
        """The point `loop` is at, before a reply that feeds at most `reach` tokens."""
        # Only what the reply can overwrite is saved: as many slots as it can feed tokens.
        return cls(CacheSnapshot.take(loop.cache, reach), logits.clone())

    def restore(self, loop: TokenLoop) -> torch.Tensor:
        """Put `loop` back where the point was taken; the logits to draw the reply from."""
        self.cache.restore(loop.cache)
        return self.logits


class TokenLoop:
    """Feeds one conversation's tokens through a sink cache and draws its replies."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        window: int,
        prefill_chunk: int,
        channel: LockstepChannel | None,
        shared_sinks: SharedSinks | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.window = window
        self.prefill_chunk = prefill_chunk
        # Under tensor parallelism: how the ranks agree on tokens and stops (streamchat.distributed).
        self.channel = channel
        self.device = model.get_input_embeddings().weight.device
        # Both come with use_sinks(): a cache's size depends on the chat format, known later.
        self._cache: SinkCache | None = None
        self._decoder: Decoder | None = None
        # Set from outside, a signal handler included: the loop heeds it between two forward passes.
        self.stop_requested = False
        # Where conversations over the same engine that begin alike share their sinks (a server's); None: not shared.
        self.shared_sinks = shared_sinks

    @property
    def cache(self) -> SinkCache:
        """The cache the conversation's tokens go through (use_sinks() makes it)."""
        if self._cache is None:
            raise CacheStateError("the token loop has no cache yet: use_sinks() makes it")
        return self._cache

    @property
    def decoder(self) -> Decoder:
        """What draws the replies from the cache (use_sinks() makes it)."""
        if self._decoder is None:
            raise CacheStateError("the token loop has no decoder yet: use_sinks() makes it")
        return self._decoder

    @property
    def sinks(self) -> int | None:
        """How many tokens the cache keeps as its sinks; None before use_sinks()."""
        return None if self._cache is None else self._cache.sinks

    def use_sinks(self, sinks: int) -> None:
        """Keep `sinks` tokens from now on, in a new, empty cache."""
        self._cache = self._decoder = None  # the old storage goes before the new one is allocated
        cache = self._cache = SinkCache.for_model(self.model, sinks, self.window)
        self._decoder = Decoder(cache, vocab_size=len(self.tokenizer), channel=self.channel)

    def reset(self) -> None:
        """Empty the cache, keeping its storage (and the decode step compiled for it, if any)."""
        self.cache.reset()

    def is_whole(self) -> bool:
        """Whether the cache holds whole steps of known tokens: no forward pass was torn off half way, and no
        reply token was fed that the host never read back (its reply abandoned in between)."""
        return self.cache.is_consistent() and UNREAD not in self.cache.held_tokens().token_ids

    def stop_agreed(self) -> bool:
        """stop() as every rank sees it: the leader's, under tensor parallelism."""
        if self.channel is None:
            return self.stop_requested
        return self.channel.agree_stop(self.stop_requested)

    # ---- the phases of a turn ---------------------------------------------------------------

    def prefill(
        self, prompt: list[int], message: int, read_all: bool, reply_room: int | None
    ) -> Generator[Event | Request, None, Prefilled]:
        """Read the prompt of transcript message `message`; a long one as a replay reads a
        conversation (streamchat.generation.requests) unless `read_all`. With `reply_room`,
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
        self,
        logits: torch.Tensor,
        reply: Reply,
        message: int,
        sampler: Sampler,
        stop_ids: frozenset[int],
        logprobs: int | None = None,
        reply_format: ReplyFormat | None = None,
    ) -> Generator[Event | Request, None, None]:
        """Draw, show and feed tokens one by one, until a stop token or string, the limit, or stop(). With
        `logprobs`, each token's log-probability is said too, with that many of the likeliest alternatives'; with
        `reply_format`, the reply is what its grammar allows (one JSON value of a schema: it ends once that is
        whole)."""
        constraint = None if reply_format is None else reply_format.constraint(self.tokenizer, stop_ids)
        self.decoder.start(logits, reply.settings, sampler, label=message, constraint=constraint)
        said = None if logprobs is None else partial(self._logprob, top=logprobs)
        decoding = DecodingReply(self.decoder, reply, stop_ids, lambda: self.stop_requested, self._evicted, said)
        with _out_of_memory_reported(self.device, "generating"):
            yield from _awaited(decoding)

    def feed(self, token_ids: list[int], message: int) -> Generator[Event | Request, None, torch.Tensor | None]:
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
    ) -> Generator[Event | Request, None, int]:
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
    ) -> Generator[Event | Request, None, tuple[torch.Tensor, int, int]]:
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
        if reading.logits is None:  # nothing was read: an empty prompt
            raise ConfigError("a prompt to read needs at least one token")
        return reading.logits, progress.read, copied

    def share_sinks(
        self, head: list[int], message: int
    ) -> Generator[Event | Request, None, tuple[torch.Tensor | None, int]]:
        """A new conversation's sinks, shared with the others over the engine that begin alike
        (engine/shared_sinks.py): copied in where one read them (once it has, when it is reading them), else read
        in a pass of their own and kept. The logits after them (None when copied), and how many of the head's
        tokens they are (0: none shared)."""
        shared, sinks = self.shared_sinks, self.cache.sinks
        if shared is None or self.cache.stats().seen or len(head) < sinks:
            return None, 0
        ids = head[:sinks]
        reading = self._reading([(ids, 0)], message)
        while (taken := shared.take(self.cache, ids, message, reading)) == "wait":
            yield shared.reader(self.cache, ids, message)  # another conversation's reading of them: its end
        if taken == "copied":
            return None, sinks
        try:
            yield from self._read(reading)
        except BaseException:  # stopped, abandoned or failed half way: the next conversation reads them
            shared.forget_reading(self.cache, ids, message)
            raise
        shared.keep(self.cache, ids, message)
        return reading.logits, sinks

    @property
    def _chunk(self) -> int:
        """The most tokens one forward pass reads."""
        return min(self.prefill_chunk, self.cache.window)

    def _reading(self, parts: list[tuple[list[int], int]], message: int, **options: Any) -> Reading:
        return Reading(self.cache, parts, message, self._chunk, self._evicted, **options)

    def _read(self, reading: Reading) -> Generator[Event | Request, None, None]:
        """Read `reading` through the cache, in the engine's steps."""
        with _out_of_memory_reported(self.device, f"reading {reading.tokens:,} tokens"):
            # Yields while the steps run: outside inference mode, which is the thread's, as the driver (the
            # server's worker) runs other conversations between two items.
            yield from _awaited(reading)

    def _make_room(self, incoming: int) -> Generator[Event, None, None]:
        """Make room ahead for `incoming` tokens; report what that evicted."""
        eviction = self.cache.evict_for_space(incoming)
        if eviction is not None:
            yield self._evicted(eviction)

    def _logprob(self, token: int, top: int) -> TokenLogprob:
        """The event for the log-probabilities of `token`, just fed, and of the `top` likeliest at its step."""
        chosen, best = self.decoder.logprobs(token, top)
        return TokenLogprob(self._token_text(token), chosen, tuple((self._token_text(t), v) for t, v in best))

    def _token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def _evicted(self, eviction: Eviction) -> Evicted:
        """The event for an eviction the cache made, with the text of the tokens that left."""
        text = self.tokenizer.decode(list(eviction.token_ids), skip_special_tokens=False)
        return Evicted(eviction.count, eviction.first_index, eviction.last_index, text, eviction.stats)


def _awaited(request: DecodingReply | Reading) -> Generator[Request, None, None]:
    """Wait for `request` to end in the engine's steps (the driver resumes the loop then); raises what ended it,
    where a failure did (its draw's, its step's)."""
    yield request
    if request.error is not None:
        raise request.error


def _out_of_memory_reported(device: torch.device, doing: str) -> AbstractContextManager[None]:
    """Within the block, running out of memory on `device` while `doing` something is an OutOfMemoryError: one line
    that says what to make smaller."""
    return out_of_memory_as(
        f"out of memory on {device} while {doing}; try a smaller --window, --dtype bfloat16 or float16, "
        "or a smaller model"
    )
