"""What a conversation asks of the engine for its next step, and what it gets back.

    DecodeRow(cache, token, token_id, label)   a reply's next token [1]: one row of the batched decode
    PromptChunk(cache, ids, label)              prompt tokens [1, n]: read into the cache in one piece
    Fed(logits, eviction)       the logits after the work's last token [1, 1, vocab], what it evicted
    Decoding                    a reply decoding in the engine: its next work each step, what it makes of the outcome

A conversation has at most one piece of work queued at a time: it needs the logits of
one to know the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch

from streamchat.cache import SinkCache
from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.cache.record import UNREAD


@dataclass(eq=False)
class DecodeRow:
    """One token to feed through a cache whose sinks are full (a row of the pooled decode step)."""

    cache: SinkCache
    token: torch.Tensor  # [1], on the model's device
    token_id: int = UNREAD  # the same token on the host, for the cache's record
    label: int = NO_LABEL  # what the cache records it with (the reply's transcript message)

    @property
    def tokens(self) -> int:
        return 1


@dataclass(eq=False)
class PromptChunk:
    """Tokens to read through a cache in one forward pass, cut where the conversation cut them."""

    cache: SinkCache
    ids: torch.Tensor  # [1, n], on the model's device
    label: int = NO_LABEL  # what the cache records them with (their transcript message)

    @property
    def tokens(self) -> int:
        return self.ids.shape[-1]


Work = DecodeRow | PromptChunk


class Fed(NamedTuple):
    """A piece of work done: the logits after its last token, and what making room for it evicted."""

    logits: torch.Tensor  # [1, 1, vocab]
    eviction: Eviction | None


class Decoding(Protocol):
    """A reply decoding in the engine's steps (streamchat.generation.engine_steps.DecodingReply): the engine asks
    it for its next work at the start of each step (its token, drawn with its own settings and seed) and hands it
    the outcome at the end (detokenized and checked for a stop there), until it ends."""

    cache: SinkCache

    def next_work(self) -> Work | None:
        """The work of its next token; None when the reply ends before it (a stop was asked for)."""

    def advance(self, fed: Fed) -> bool:
        """What the step made of its work; False when the reply ends there."""

    def end(self, error: BaseException | None) -> None:
        """The reply ended, or failed with `error` (its step's, or its own): the engine holds it no longer."""


class Ticket:
    """Where a piece of work's outcome lands once a step ran it: Fed, or the failure of its step; or, for a
    decoding reply's work, the reply it goes on with."""

    def __init__(self, work: Work, reply: Decoding | None = None) -> None:
        self.work = work
        self.reply = reply
        self._outcome: Fed | BaseException | None = None

    @property
    def done(self) -> bool:
        return self._outcome is not None

    def settle(self, outcome: Fed | BaseException) -> None:
        self._outcome = outcome

    def result(self) -> Fed:
        """What the step gave; raises the step's failure (out of memory, a bug) in whoever waits for it."""
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome
