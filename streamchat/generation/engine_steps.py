"""A conversation's forward passes, taken by the engine in steps shared with other conversations.

    steps = EngineSteps(engine)
    # in the conversation's token loop, when its session runs in the engine (streamchat serve):
    decoded = yield from steps.next(decoder, stop_requested)   # StepQueued until the step that fed it ran
    fed = yield from steps.read(cache, ids, label)              # a prompt chunk, the same way
    steps.leave(decoder)                                        # its reply ended
    # whoever drives the conversations (the server's worker), after each round:
    engine.step()

Each row draws its own token, from its own logits, with its own settings and seeded
sampler, exactly as its Decoder does alone; the engine only feeds the tokens together
(streamchat.engine). A conversation yields StepQueued while its work waits, so whoever
drives it can move every other conversation up to its next piece of work before the step.
A conversation that has the engine to itself (`drives`: the chat, a piped run) runs the
step itself instead, and yields nothing.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from streamchat.cache import SinkCache
from streamchat.engine.engine import Engine
from streamchat.engine.work import DecodeRow, Fed, PromptChunk, Work
from streamchat.errors import CacheStateError
from streamchat.generation.decoder import Decoded, Decoder
from streamchat.generation.events import StepQueued


class EngineSteps:
    """What a token loop hands the engine, and how it waits for the step that runs it."""

    def __init__(self, engine: Engine, drives: bool = False) -> None:
        self.engine = engine
        self.drives = drives  # the engine is this conversation's alone: it runs each step as its work is queued

    def next(self, decoder: Decoder, stop_requested: bool = False) -> Generator[StepQueued, None, Decoded | None]:
        """Decoder.next() in the engine: the token drawn and fed (StepQueued until then); None on stop().
        Under tensor parallelism every rank's engine feeds the token the leader drew."""
        settled = decoder.draw_agreed(stop_requested)
        if settled is None:
            return None
        decoder.checkpoint()  # what take_back() returns to: the cache as it is before the step
        cache, label = decoder.cache, decoder.label
        if cache.ledger.sinks_full:
            fed = yield from self._wait(DecodeRow(cache, settled.on_device, settled.token, label))
        else:  # a conversation shorter than its sinks: its token is a chunk of one (a decode row needs them full)
            fed = yield from self._wait(PromptChunk(cache, settled.on_device.reshape(1, 1), label))
        decoder.fed(fed.logits)
        return Decoded(settled.token, fed.eviction)

    def read(self, cache: SinkCache, ids: torch.Tensor, label: int) -> Generator[StepQueued, None, Fed]:
        """Read prompt tokens ids [1, n] into `cache` in one step's pass, recorded with `label`; the logits after
        them."""
        return (yield from self._wait(PromptChunk(cache, ids, label)))

    def leave(self, decoder: Decoder) -> None:
        """`decoder`'s reply ended (or its turn was abandoned): its row leaves the pool, between steps."""
        self.engine.leave(decoder.cache)

    def _wait(self, work: Work) -> Generator[StepQueued, None, Fed]:
        ticket = self.engine.queue(work)
        try:
            while not ticket.done:
                if not self.drives:
                    yield StepQueued()
                elif not self.engine.step():
                    raise CacheStateError("the engine's step ran nothing: is another conversation using it?")
        finally:
            if not ticket.done:  # abandoned while queued (or interrupted): no step may feed it behind its back
                self.engine.withdraw(ticket)
        return ticket.result()
