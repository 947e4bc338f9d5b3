"""A conversation's forward passes, taken by the engine in steps shared with other conversations.

    steps = EngineSteps(engine)
    # in the conversation's token loop, when its session runs in the engine (streamchat serve):
    reply = DecodingReply(decoder, reply, stop_ids, stop_requested, evicted)
    yield from steps.decode(reply)                  # its events, a step's worth at a time
    fed = yield from steps.read(cache, ids, label)  # a prompt chunk: StepQueued until the step that read it ran
    steps.leave(decoder)                            # its turn ended, or was abandoned
    # whoever drives the conversations (the server's worker), after each round:
    engine.step()

A decoding reply is the engine's to step (streamchat.engine): at the start of each step it
draws its token from its own logits, with its own settings and seeded sampler, exactly as
its Decoder does alone; at the end it reads the logits the step gave, detokenizes the
token and checks it for a stop. Its events wait in it until its conversation hands them on.
A conversation yields StepQueued while it waits for a step, so whoever drives it can move
every other conversation on before the step. A conversation that has the engine to itself
(`drives`: the chat, a piped run) runs the step itself instead, and yields nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

import torch

from streamchat.cache import SinkCache
from streamchat.cache.ledger import Eviction
from streamchat.engine.engine import Engine
from streamchat.engine.work import DecodeRow, Fed, PromptChunk, Work
from streamchat.errors import CacheStateError
from streamchat.generation.decoder import Decoder
from streamchat.generation.events import CacheOccupancy, Event, Evicted, StepQueued, TextDelta
from streamchat.generation.reply import Reply


class DecodingReply:
    """A reply being decoded: what each token fed means for it (settle), and, in the engine's steps
    (engine/work.py: Decoding), its next token drawn and its step's outcome."""

    def __init__(
        self,
        decoder: Decoder,
        reply: Reply,
        stop_ids: frozenset[int],
        stop_requested: Callable[[], bool],
        evicted: Callable[[Eviction], Evicted],
    ) -> None:
        self.decoder, self.reply, self.stop_ids = decoder, reply, stop_ids
        self.cache: SinkCache = decoder.cache
        self.events: list[Event] = []  # said since the conversation last took them
        self.ended = False
        self.error: BaseException | None = None
        self._stop_requested = stop_requested
        self._evicted = evicted
        self._token = 0  # the token its work feeds

    def next_work(self) -> Work | None:
        """Its next token drawn (the leader's, under tensor parallelism), as work to feed; None on stop()."""
        settled = self.decoder.draw_agreed(self._stop_requested())
        if settled is None:
            self.reply.reason = "interrupted"
            return None
        self.decoder.checkpoint()  # what take_back() returns to: the cache as it is before the step
        self._token = settled.token
        cache, label = self.cache, self.decoder.label
        if cache.ledger.sinks_full:
            return DecodeRow(cache, settled.on_device, settled.token, label)
        # A conversation shorter than its sinks: its token is a chunk of one (a decode row needs them full).
        return PromptChunk(cache, settled.on_device.reshape(1, 1), label)

    def advance(self, fed: Fed) -> bool:
        """The step fed its token: the logits the next one is drawn from, and what the token means; False at
        the end."""
        self.decoder.fed(fed.logits)
        return self.settle(self._token, fed.eviction)

    def settle(self, token: int, eviction: Eviction | None) -> bool:
        """`token` was fed (making room evicted `eviction`): its text and eviction said, or taken back where it
        ends the reply; False when the reply ends there."""
        if token in self.stop_ids:  # fed as a guess; it ends the reply without belonging in the cache
            self.decoder.take_back()
            self.reply.reason = "eos"
            return False
        if delta := self.reply.add(token):
            self.events.append(TextDelta(delta))
        if eviction is not None:
            self.events.append(self._evicted(eviction))
        if self.reply.reason == "stop_string" or len(self.reply.ids) >= self.reply.settings.max_new_tokens:
            return False
        self.events.append(CacheOccupancy(self.cache.stats(), self.reply.decode_speed()))
        return True

    def end(self, error: BaseException | None) -> None:
        self.ended, self.error = True, error

    def said(self) -> list[Event]:
        """The events since the last call; raises the failure that ended the reply, if one did."""
        if self.error is not None:
            raise self.error
        events, self.events = self.events, []
        return events


class EngineSteps:
    """What a token loop hands the engine, and how it waits for the step that runs it."""

    def __init__(self, engine: Engine, drives: bool = False) -> None:
        self.engine = engine
        self.drives = drives  # the engine is this conversation's alone: it runs each step as its work is queued

    def decode(self, reply: DecodingReply) -> Generator[Event, None, None]:
        """Decode `reply` in the engine's steps until it ends; its events after each step (StepQueued between)."""
        self.engine.submit(reply)
        while not reply.ended:
            yield from self._next_step(lambda: reply.ended)
            yield from reply.said()

    def read(self, cache: SinkCache, ids: torch.Tensor, label: int) -> Generator[StepQueued, None, Fed]:
        """Read prompt tokens ids [1, n] into `cache` in one step's pass, recorded with `label`; the logits after
        them."""
        ticket = self.engine.queue(PromptChunk(cache, ids, label))
        try:
            while not ticket.done:
                yield from self._next_step(lambda: ticket.done)
        finally:
            if not ticket.done:  # abandoned while queued (or interrupted): no step may feed it behind its back
                self.engine.withdraw(ticket)
        return ticket.result()

    def leave(self, decoder: Decoder) -> None:
        """`decoder`'s reply ended (or its turn was abandoned): its row leaves the pool, between steps."""
        self.engine.leave(decoder.cache)

    def _next_step(self, done: Callable[[], bool]) -> Generator[StepQueued, None, None]:
        """Until the engine's next step ran: whoever drives the conversations runs it, or this one does (a step
        that runs nothing is fine when the wait is over: a reply stopped before its token was drawn)."""
        if not self.drives:
            yield StepQueued()
        elif not self.engine.step() and not done():
            raise CacheStateError("the engine's step ran nothing: is another conversation using it?")
