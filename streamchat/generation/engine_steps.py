"""A conversation's forward passes, taken by the engine in steps shared with other conversations.

    steps = EngineSteps(engine)
    # in the conversation's token loop, when its session runs in the engine:
    reply = DecodingReply(decoder, reply, stop_ids, stop_requested, evicted)
    yield from steps.run(reply)    # Waiting(reply) until it ended, then what it said last
    yield from steps.run(reading)  # a text to read (generation/prompt_reading.py: Reading), the same way
    copied = yield from steps.copy_sinks(cache, ids, label)  # a new conversation's sinks, where another read them
    step = engine_step(model, decoder)  # a benchmark's: each call, the next token of an endless reply
    engine.submit(EndlessReply(decoder))  # a benchmark's reply that never ends, beside others in one engine
    # whoever drives the conversations (the server's worker), each round:
    engine.step()                  # then each request's events: request.said()

A decoding reply is the engine's to step (streamchat.engine): at the start of each step it
draws its token from its own logits, with its own settings and seeded sampler (its
Decoder; on a GPU the host reads the token back once the step that feeds it is queued);
at the end it reads the logits the step gave, detokenizes the token and checks it for a
stop. A text being read (a prompt, a replayed message) is the engine's the same way, a
chunk a step. Their events wait in them: whoever drives the engine takes them after each
step, and resumes the conversation only once the request ended, so a token's text reaches
its client without passing through the conversation's turn. A conversation yields
Waiting, not an event, while it waits for steps. One that has the engine to itself
(`drives`: its own engine, the chat's and a piped run's) runs the steps itself instead,
yields the request's events after each, and never Waiting.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

from streamchat.cache import SinkCache
from streamchat.cache.ledger import Eviction
from streamchat.engine.engine import Engine
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.engine.work import DecodeRow, Fed, PromptChunk, Work
from streamchat.errors import CacheStateError
from streamchat.generation.decoder import Decoder, Drawn
from streamchat.generation.events import CacheOccupancy, Compiled, Compiling, Event, Evicted, TextDelta
from streamchat.generation.prompt_reading import Reading
from streamchat.generation.reply import Reply


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
    ) -> None:
        self.decoder, self.reply, self.stop_ids = decoder, reply, stop_ids
        self.cache: SinkCache = decoder.cache
        self.events: list[Event] = []  # said since the conversation last took them
        self.ended = False
        self.error: BaseException | None = None
        self.stop_requested = stop_requested  # the conversation's stop(), heeded before each draw
        self._evicted = evicted

    def next_work(self) -> Work | None:
        """Its next token drawn (the leader's, under tensor parallelism), as work to feed; None on stop()."""
        drawn = self.decoder.draw_agreed(self.stop_requested())
        if drawn is None:
            self.reply.reason = "interrupted"
            return None
        return _token_work(self.decoder, drawn)

    def advance(self, fed: Fed) -> bool:
        """The step fed its token: the logits the next one is drawn from, and what the token means; False at
        the end. A guess drawn again says nothing: its step never happened, the next feeds the token."""
        token = self.decoder.fed(fed.logits)
        return True if token is None else self._settle(token, fed.eviction)

    def _settle(self, token: int, eviction: Eviction | None) -> bool:
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
        """The events since the last call (whoever takes them: the conversation, or the engine's driver)."""
        events, self.events = self.events, []
        return events


@dataclass(frozen=True)
class Waiting:
    """A conversation sharing the engine waits for a step: whoever drives the engine moves the others on, then
    runs it. With `request`, it waits for that request (a DecodingReply, a Reading) to end, however many steps
    that takes: its events wait in it after each step, for the driver to hand on (or for the conversation,
    resumed early, to yield)."""

    request: DecodingReply | Reading | None = None


class EndlessReply:
    """A reply decoding in the engine that never ends and says nothing but its tokens: a benchmark's steps."""

    def __init__(self, decoder: Decoder) -> None:
        self.decoder, self.cache = decoder, decoder.cache
        self.error: BaseException | None = None
        self.decoded: Decoded | None = None  # the last step's token and eviction (None: its guess was redrawn)

    def next_work(self) -> Work:
        return _token_work(self.decoder, self.decoder.draw())

    def advance(self, fed: Fed) -> bool:
        token = self.decoder.fed(fed.logits)
        self.decoded = None if token is None else Decoded(token, fed.eviction)
        return True

    def end(self, error: BaseException | None) -> None:
        self.error = error


@dataclass(frozen=True)
class Decoded:
    """A token drawn and fed, and what feeding it evicted."""

    token: int
    eviction: Eviction | None


def engine_step(model: Any, decoder: Decoder, compile_backend: str | None = None) -> Callable[[], Decoded]:
    """Each call, the next token of `decoder`'s reply, decoding alone in an engine of its own as the chat's does
    (its text aside; with `compile_backend`, its step compiled): for a benchmark to time, a test to read."""
    engine, reply = Engine(model, compile_backend=compile_backend), EndlessReply(decoder)
    engine.submit(reply)

    def step() -> Decoded:
        reply.decoded = None
        while reply.decoded is None:  # a guess drawn again takes one more step
            engine.step()
            if reply.error is not None:
                raise reply.error
        return reply.decoded

    return step


def _token_work(decoder: Decoder, drawn: Drawn) -> Work:
    """A token drawn, as work to feed: a decode row, or a chunk of one while the cache's sinks are not full yet (a
    decode row needs them full). Its decoder's checkpoint first: what take_back() returns to."""
    decoder.checkpoint()
    cache, label = decoder.cache, decoder.label
    if cache.ledger.sinks_full:
        return DecodeRow(cache, drawn.on_device, drawn.token_id, label)
    return PromptChunk(cache, drawn.on_device.reshape(1, 1), label)


class EngineSteps:
    """What a token loop hands the engine, and how it waits for the step that runs it."""

    def __init__(self, engine: Engine, drives: bool = False, shared_sinks: SharedSinks | None = None) -> None:
        self.engine = engine
        self.drives = drives  # the engine is this conversation's alone: it runs each step as its work is queued
        self.shared_sinks = shared_sinks  # where conversations that begin alike share their sinks

    def run(self, request: DecodingReply | Reading) -> Generator[Event | Waiting, None, None]:
        """Work on `request` in the engine's steps until it ends: its events after each step it runs itself, or
        Waiting(request) while another drives the steps (and takes the events); what is left after it ended.
        Raises what ended it, when a failure did (its draw's, its step's)."""
        self.engine.submit(request)
        try:
            while not request.ended:
                if self.drives:
                    yield from self._run_step(request)
                else:
                    yield Waiting(request)
                yield from request.said()
            # What it said in steps run while the last of those were handed on (the driver steps the engine while
            # the conversation waits on any of its yields): its reply's last text, its turn's end.
            yield from request.said()
        finally:
            if not request.ended:  # abandoned (or interrupted): no step may go on with it behind its back
                self.engine.leave(request.cache)
        if request.error is not None:
            raise request.error

    def copy_sinks(self, cache: SinkCache, ids: list[int], label: int) -> Generator[Waiting, None, bool]:
        """Into the empty `cache`, the sinks `ids` as another conversation read them (waiting while one reads
        them): True; False when none did: this conversation reads them, then hands them to shared_sinks.keep()."""
        while (taken := self.shared_sinks.take(cache, ids, label)) == "wait":
            yield Waiting()
        return taken == "copied"

    def _run_step(self, request: DecodingReply | Reading) -> Generator[Event, None, None]:
        """Run the engine's next step, this conversation's alone (one that runs nothing is fine when the wait is
        over: a reply stopped before its token was drawn). A step that compiles first says so, before and after."""
        runner = self.engine.runner
        compiling = (
            isinstance(request, DecodingReply) and runner.will_compile(request.cache) and not request.stop_requested()
        )
        if compiling:
            yield Compiling()
        if not self.engine.step() and not request.ended:
            raise CacheStateError("the engine's step ran nothing: is another conversation using it?")
        if compiling and not runner.will_compile(request.cache):
            yield Compiled(runner.compiled.seconds)
