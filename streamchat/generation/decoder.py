"""Decoder: a reply's tokens drawn from the logits of each step, one step ahead of the host.

    decoder = Decoder(cache)
    decoder.start(logits, settings, sampler, label)   # the logits after the prompt; the draw composed
    each engine step (streamchat.generation.requests):
        drawn = decoder.draw()              # the next token on the device (and on the host, where it waits)
        decoder.checkpoint()                # what take_back() returns to
        ... the step feeds drawn.on_device ...
        token = decoder.fed(logits)         # the token it fed, settled; None: redrawn, the step never happened
        if it ends the reply without belonging in the cache:
            decoder.take_back()             # the step that fed it never happened

On an accelerator a drawn token goes straight into the step that feeds it as a device
tensor: the host reads it only after that step is queued, so the device computes step t
while the host waits for token t alone, then detokenizes it (mlx-lm's generate loop does
the same). The step is a guess when the draw's shortlist could not decide: fed() then
takes the step back, which costs nothing (cache/ledger.py: decode steps only write free
slots), and the next draw() is the token drawn again over the whole vocabulary. On a CPU
the host waits for the step anyway, so the token is settled before it is fed. The
repetition penalty reads the cache's own record of its tokens, on the device (the host's
record, which names each token for views and evictions, learns a token when the host
reads it back); the frequency and presence penalties read how often each token was fed
in this reply, a count on the device that start() zeroes and each settled step adds its
token to (take_back() takes it out again). A reply's count never outlives it: /regen
starts the reply again, and a conversation is snapshotted whole only between replies, so
no state of it is saved or restored. A reply with a grammar (streamchat.generation.constraint)
draws only from the tokens it allows next, and each token fed (or taken back) moves it.

Under tensor parallelism (streamchat.distributed) every rank decodes in lockstep: a
`LockstepChannel` makes rank 0 draw and broadcast each token, or the news that the reply
stops there, and the other ranks feed what they are told. Without one, nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from streamchat.cache import SinkCache
from streamchat.cache.ledger import NO_LABEL
from streamchat.cache.record import UNREAD
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.errors import CacheStateError
from streamchat.generation.constraint import Constraint
from streamchat.generation.sampling import (
    Draw,
    Sampler,
    Settled,
    TokenDraw,
    make_draw,
    penalize_counts,
    penalize_held,
)
from streamchat.generation.settings import GenerationSettings

_T = TypeVar("_T")


class LockstepChannel(Protocol):
    """How the ranks of a tensor-parallel run agree on each step (streamchat.distributed.lockstep)."""

    leads: bool  # this rank draws; the others are told

    def share_token(self, token: int | None) -> int | None:
        """The leader's token, or None where its reply stops; the leader passes its own."""

    def agree_stop(self, requested: bool) -> bool:
        """Whether the leader asked to stop (between two forward passes of a prompt)."""


@dataclass(frozen=True)
class Drawn:
    """A token drawn, to feed: [1] on the device, and its id on the host (UNREAD until fed() reads it)."""

    on_device: torch.Tensor
    token_id: int


class Decoder:
    """Draws and settles reply tokens for one session's cache, a step at a time."""

    def __init__(self, cache: SinkCache, vocab_size: int | None = None, channel: LockstepChannel | None = None) -> None:
        self.cache = cache
        self.channel = channel
        # Rows past the tokenizer's vocabulary (padding some models add) are never drawn.
        self.vocab_size = vocab_size
        self._reader = _Reader(cache.device)
        self._row: torch.Tensor | None = None  # the logits the next token is drawn from [vocab]
        self._previous_row: torch.Tensor | None = None
        self._settings = GenerationSettings()
        self._draw: TokenDraw | None = None  # composed for the reply's settings by start()
        # A draw not read back yet (the logits it was drawn from, the draw), or one settled before its step.
        self._unread: tuple[torch.Tensor, Draw] | None = None
        self._settled: Settled | None = None
        # How often each token was fed in this reply [vocab]; None when no penalty reads it.
        self._counts: torch.Tensor | None = None
        self._one: torch.Tensor | None = None  # [1], what a step adds to its token's count
        self._counted: torch.Tensor | None = None  # [1], the token last counted, for take_back()
        self._checkpoint: CacheSnapshot | None = None
        self._constraint: Constraint | None = None  # the reply's grammar, where it has one
        self.label = NO_LABEL  # what the cache records the reply's tokens with (start() sets it)

    def start(
        self,
        logits: torch.Tensor,
        settings: GenerationSettings,
        sampler: Sampler,
        label: int = NO_LABEL,
        constraint: Constraint | None = None,
    ) -> None:
        """Decode from `logits` [1, n, vocab] (the last position's count) with these settings; the cache
        records every token fed with `label`; with `constraint`, only the tokens its grammar allows are drawn.

        The draw is composed here, once per reply; its uniform numbers come from `sampler`.
        """
        self._row, self._settings, self.label = self._last_row(logits), settings, label
        self._constraint = constraint
        self._draw = make_draw(settings, sampler)
        self._unread = self._settled = None
        self._counts = self._one = self._counted = None
        if settings.counts_reply_tokens:
            # Zero for every token: the penalties count this reply's tokens only, not the prompt's.
            self._counts = torch.zeros_like(self._row)
            self._one = torch.ones(1, device=self._row.device)

    def draw(self) -> Drawn:
        """The next token from the logits after the last one fed: read back to the host after its step where
        the device runs ahead of the host, else now. A token drawn again after its step was taken back is
        the next one."""
        if self._settled is not None:  # drawn again over the whole vocabulary: fed() took its guess back
            return Drawn(self._settled.on_device, self._settled.token)
        row = self._penalized(_required(self._row, "draw() before start()"))
        if self._constraint is not None:
            row = self._constraint.masked(row)
        draw = _required(self._draw, "draw() before start()")
        drawn = draw(row)
        self._reader.send(drawn)
        if self._reader.asynchronous and self.channel is None:
            self._unread = (row, drawn)
            return Drawn(drawn.token, UNREAD)
        self._settled = draw.settle(row, drawn, self._reader.receive())
        return Drawn(self._settled.on_device, self._settled.token)

    def draw_agreed(self, stop_requested: bool) -> Drawn | None:
        """draw() as every rank agrees on it: under tensor parallelism the leader draws and the others are told.
        None where the reply stops instead (`stop_requested`: the leader's, under a channel)."""
        if self.channel is None:
            return None if stop_requested else self.draw()
        token = self.draw().token_id if self.channel.leads and not stop_requested else None
        token = self.channel.share_token(token)
        if token is None:
            self._settled = None
            return None
        self._settled = Settled(token, torch.tensor([token], device=self.cache.device), redrawn=False)
        return Drawn(self._settled.on_device, token)

    def checkpoint(self) -> None:
        """Before a step feeds the drawn token: what take_back() returns to."""
        self._checkpoint, self._previous_row = CacheSnapshot.take(self.cache), self._row

    def fed(self, logits: torch.Tensor) -> int | None:
        """A step fed the drawn token: `logits` [1, 1, vocab] are its row's, the next token is drawn from them.
        The token, settled; None where it was a guess drawn again: the step is taken back, the next draw()
        is the token to feed."""
        settled, self._settled = self._settled, None
        if settled is None:  # fed before the host read it
            (row, drawn), self._unread = _required(self._unread, "fed() before draw()"), None
            settled = _required(self._draw, "fed() before start()").settle(row, drawn, self._reader.receive())
            if settled.redrawn:
                self._settled = settled
                _required(self._checkpoint, "fed() before checkpoint()").restore(self.cache)
                return None
            self.cache.learn_token(settled.token)
        if self._constraint is not None:
            self._constraint.accept(settled.token)
        self._row = self._last_row(logits)
        if self._counts is not None:
            one = _required(self._one, "fed() before start()")  # start() sets both
            self._counts.index_add_(0, settled.on_device, one)  # on the device: no host sync
            self._counted = settled.on_device
        return settled.token

    def logprobs(self, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
        """The last token fed, `token`: its log-probability under the logits it was drawn from (the model's own,
        before any penalty or temperature), and the `top` likeliest tokens' there, best first."""
        row = self._previous_row
        if row is None:
            raise CacheStateError("the decoder's log-probabilities were asked for before a token was fed")
        logprobs = torch.log_softmax(row, dim=-1)
        values, ids = logprobs.topk(top) if top else (logprobs[:0], logprobs[:0].long())
        chosen, *best = torch.cat((logprobs[token].reshape(1), values)).tolist()
        return chosen, list(zip(ids.tolist(), best, strict=True))

    def take_back(self) -> None:
        """Undo the step that fed the last token (exactly: nothing it overwrote was held), its count included."""
        _required(self._checkpoint, "take_back() before checkpoint()").restore(self.cache)
        self._row = self._previous_row
        if self._constraint is not None:
            self._constraint.take_back()
        if self._counted is not None:
            order = "take_back() before start()"
            counts, one = _required(self._counts, order), _required(self._one, order)
            counts.index_add_(0, self._counted, one, alpha=-1)
            self._counted = None

    # ---- the phases of a draw ----------------------------------------------------------

    def _last_row(self, logits: torch.Tensor) -> torch.Tensor:
        """The last position's logits [vocab] as a float32 copy: a compiled step reuses its output buffer."""
        row = logits[0, -1]
        if self.vocab_size is not None and row.shape[-1] > self.vocab_size:
            row = row[: self.vocab_size]
        return row.to(torch.float32, copy=True)

    def _penalized(self, row: torch.Tensor) -> torch.Tensor:
        """The logits a token is drawn from: the repetition penalty, then the frequency and presence penalties."""
        settings = self._settings
        if settings.repetition_penalty != 1.0:
            occupancy = self.cache.occupancy
            row = penalize_held(row, occupancy.token_ids, occupancy.held, settings.repetition_penalty)
        if self._counts is not None:
            row = penalize_counts(row, self._counts, settings.frequency_penalty, settings.presence_penalty)
        return row


class _Reader:
    """Token ids back to the host: on CUDA through pinned memory and an event, so only the token is waited for."""

    def __init__(self, device: torch.device) -> None:
        self.asynchronous = device.type == "cuda"
        self._values: torch.Tensor | None = None
        if self.asynchronous:
            self._host = torch.empty(2, dtype=torch.long, pin_memory=True)
            self._ready = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch's Event.__init__ is unannotated

    def send(self, drawn: Draw) -> None:
        """Start copying the draw's token and settled flag to the host."""
        values = torch.cat((drawn.token.reshape(1), drawn.settled.reshape(1).long()))
        if self.asynchronous:
            self._host.copy_(values, non_blocking=True)
            self._ready.record()
        else:
            self._values = values

    def receive(self) -> tuple[int, bool]:
        if self.asynchronous:
            self._ready.synchronize()
            token, settled = self._host.tolist()
        else:
            token, settled = _required(self._values, "receive() before send()").tolist()
        return token, bool(settled)


def _required(value: _T | None, order: str) -> _T:
    """`value`, set by a call that comes first; CacheStateError where the decoder was driven out of `order`."""
    if value is None:
        raise CacheStateError(f"the decoder was driven out of order: {order}")
    return value
