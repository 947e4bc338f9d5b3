"""What a conversation asks of the engine for its next step, and what it gets back.

    DecodeRow(cache, token, token_id, label)   a reply's next token [1]: one row of the batched decode
    PromptChunk(cache, ids, label)              prompt tokens [1, n]: read into the cache in one piece
    Fed(logits, eviction)       the logits after the work's last token [1, 1, vocab], what it evicted
    Request                     a reply decoding or a text being read: its next work each step, what it makes
                                of the outcome (Advanced: what it says, whether it goes on)
    Output(request, events, ended, error)   what a step did for one request: what Engine.step() returns
    Ticket(work, request)       a piece of work queued, and whose it is

A conversation has at most one piece of work queued at a time: it needs the logits of
one to know the next.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from streamchat.cache import SinkCache
from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.cache.record import UNREAD


@dataclass(eq=False)
class DecodeRow:
    """One token to feed through a cache whose sinks are full (a row of the batched decode step)."""

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


class Advanced(NamedTuple):
    """What a request made of its step's work: what it says of it (its own events: a reply's text, an eviction,
    a read's progress), and whether it goes on."""

    events: tuple[object, ...]
    goes_on: bool


@runtime_checkable
class Request(Protocol):
    """What a conversation asks of the engine's steps until it ends: a reply to decode
    (streamchat.generation.requests.DecodingReply) or a text to read (streamchat.generation.requests.Reading).
    The engine asks it for its next work at the start of each step (a reply's token, drawn with its own settings
    and seed; a text's next chunk) and hands it the outcome at the end (a token detokenized and checked for a
    stop there; a chunk's eviction and progress)."""

    cache: SinkCache

    def next_work(self) -> Work | None:
        """The work of its next step; None when it ends before it (a stop was asked for)."""

    def advance(self, fed: Fed) -> Advanced:
        """What the step made of its work: what it says, and whether it goes on."""

    def end(self, error: BaseException | None) -> None:
        """It ended, or failed with `error` (its step's, or its own): the engine holds it no longer."""


@dataclass(frozen=True, eq=False)
class Output:
    """What a step did for one request: what it said, and whether it ended there (with `error`, where a failure
    ended it: its step's, or its own)."""

    request: Request
    events: tuple[object, ...] = ()
    ended: bool = False
    error: BaseException | None = None


class Ticket(NamedTuple):
    """A piece of work queued for a step, and the request it goes on with."""

    work: Work
    request: Request
