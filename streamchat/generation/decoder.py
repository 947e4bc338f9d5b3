"""The token loop: draw a token on the device, feed it back, read it on the host, one step ahead.

    decoder = Decoder(model, cache)                # or compile_backend="inductor"
    decoder.start(logits, settings, sampler, label)   # the logits after the prompt; the draw composed
    while ...:
        token = decoder.next()                    # drawn and already fed; its step's eviction
        if it ends the reply without belonging in the cache:
            decoder.take_back()                   # the step that fed it never happened

A drawn token goes straight back into the model as a device tensor. The host reads
it only after the step that feeds it is queued, so on an accelerator the device
computes step t+1 while the host detokenizes token t (mlx-lm's generate loop does the
same). That step is a guess: when token t turns out to end the reply (an end-of-turn
token the template closes differently), take_back() rolls the cache back, which costs
nothing (cache/ledger.py: decode steps only write free slots). The repetition penalty
reads the cache's own record of its tokens, on the device (the host's record, which
names each token for views and evictions, learns a token when the host reads it back,
or before the step where the host knew it first); the frequency and presence
penalties read how often each token was drawn in this reply, a count on the device that
start() zeroes and each settled draw adds its token to (take_back() takes it out again).
A reply's count never outlives it: /regen starts the reply again, and a conversation is
snapshotted whole only between replies, so no state of it is saved or restored.

Under tensor parallelism (streamchat.distributed) every rank runs this loop in lockstep:
a `StepChannel` makes rank 0 draw and broadcast each token, or the news that the reply
stops there, and the other ranks feed what they are told. Without one, nothing changes.

A decode step has fixed shapes once the sinks are full, so it can be compiled into one
graph (CUDA graphs on a GPU); before that, and on request, steps run eagerly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from streamchat import defaults
from streamchat.cache import SinkCache, forward
from streamchat.cache.feeding import step_logits
from streamchat.cache.ledger import NO_LABEL, Eviction
from streamchat.cache.record import UNREAD
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.errors import ConfigError
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
from streamchat.placement.lean_forward import lean_forward_for


def decode_step(model: Any, cache: SinkCache, token: torch.Tensor) -> torch.Tensor:
    """The body of `with cache.decode_step()` for token [1, 1]: logits [1, 1, vocab]. Compilable."""
    return step_logits(model, cache, token, cache.decode_inputs(token))


def step_function(model: Any, lean: bool = True) -> Any:
    """decode_step, or the same step through the lean forward where the model has one (placement/lean_forward.py)."""
    forward = lean_forward_for(model) if lean else None
    if forward is None:
        return decode_step

    def lean_decode_step(model: Any, cache: SinkCache, token: torch.Tensor) -> torch.Tensor:
        inputs = cache.decode_inputs(token)
        return forward(token, inputs.position_ids, inputs.attention_mask, cache)

    return lean_decode_step


class StepChannel(Protocol):
    """How the ranks of a tensor-parallel run agree on each step (streamchat.distributed.lockstep)."""

    leads: bool  # this rank draws; the others are told

    def share_token(self, token: int | None) -> int | None:
        """The leader's token, or None where its reply stops; the leader passes its own."""

    def agree_stop(self, requested: bool) -> bool:
        """Whether the leader asked to stop (between two forward passes of a prompt)."""


@dataclass(frozen=True)
class Decoded:
    """A token drawn and fed, and what feeding it evicted."""

    token: int
    eviction: Eviction | None


class Decoder:
    """Draws, feeds and reads reply tokens for one session's model and cache."""

    def __init__(
        self,
        model: Any,
        cache: SinkCache,
        compile_backend: str | None = None,
        vocab_size: int | None = None,
        channel: StepChannel | None = None,
        lean: bool = True,
    ) -> None:
        self.model = model
        self.channel = channel
        self.cache = cache
        self.device = model.get_input_embeddings().weight.device
        self.compiled = compile_backend is not None
        cache.static_extent = self.compiled
        # Rows past the tokenizer's vocabulary (padding some models add) are never drawn.
        self.vocab_size = vocab_size
        self.compile_seconds: float | None = None  # how long the first compiled step took
        step = step_function(model, lean)
        self._step_fn = _compiled_step(self.device, compile_backend, step) if compile_backend else step
        self._reader = _Reader(self.device)
        self._row: torch.Tensor | None = None  # the logits the next token is drawn from [vocab]
        self._previous_row: torch.Tensor | None = None
        self._settings = GenerationSettings()
        self._draw: TokenDraw | None = None  # composed for the reply's settings by start()
        # How often each token was drawn in this reply [vocab]; None when no penalty reads it.
        self._counts: torch.Tensor | None = None
        self._one: torch.Tensor | None = None  # [1], what a draw adds to its token's count
        self._counted: torch.Tensor | None = None  # [1], the token last counted, for take_back()
        self._checkpoint: CacheSnapshot | None = None
        self.label = NO_LABEL  # what the cache records the reply's tokens with (start() sets it)

    @property
    def will_compile(self) -> bool:
        """Whether the next step compiles first (the UI says so: it takes a while)."""
        return self.compiled and self.compile_seconds is None and self.cache.ledger.sinks_full

    def start(
        self, logits: torch.Tensor, settings: GenerationSettings, sampler: Sampler, label: int = NO_LABEL
    ) -> None:
        """Decode from `logits` [1, n, vocab] (the last position's count) with these settings; the cache
        records every token fed with `label`.

        The draw is composed here, once per reply; its uniform numbers come from `sampler`.
        """
        self._row, self._settings, self.label = self._last_row(logits), settings, label
        self._draw = make_draw(settings, sampler)
        self._counts = self._one = self._counted = None
        if settings.counts_reply_tokens:
            # Zero for every token: the penalties count this reply's tokens only, not the prompt's.
            self._counts = torch.zeros_like(self._row)
            self._one = torch.ones(1, device=self._row.device)

    def next(self, stop_requested: bool = False) -> Decoded | None:
        """Draw the next token, feed it, and read it back; None when the reply stops here instead.

        `stop_requested` is the caller's stop(): with a channel, the leader's decides for every rank.
        """
        if self.channel is not None:
            return self._next_in_lockstep(stop_requested)
        if stop_requested:
            return None
        if not self._reader.asynchronous:
            # The host waits for the token anyway: settle the draw before feeding it.
            settled = self.draw()
            return Decoded(settled.token, self._feed(settled.on_device, settled.token))
        row = self._penalized(self._row)
        drawn = self._draw(row)
        self._reader.send(drawn)
        eviction = self._feed(drawn.token)  # queued before the token is read: the device keeps busy
        settled = self._draw.settle(row, drawn, self._reader.receive())
        if settled.redrawn:
            # The shortlist could not decide: take back the step that fed its guess, feed the redraw.
            self._restore()
            eviction = self._feed(settled.on_device, settled.token)
        else:
            self.cache.learn_token(settled.token)  # fed before the host read it
        self._count(settled.on_device)
        return Decoded(settled.token, eviction)

    # ---- the phases of a step, for a batch that feeds several decoders at once (generation/engine_steps.py) ----

    def draw(self) -> Settled:
        """Draw the next token from the logits after the last one fed, settled on the host before it is fed."""
        row = self._penalized(self._row)
        drawn = self._draw(row)
        self._reader.send(drawn)
        settled = self._draw.settle(row, drawn, self._reader.receive())
        self._count(settled.on_device)
        return settled

    def feed(self, token: torch.Tensor, token_id: int = UNREAD) -> Eviction | None:
        """Feed token [1] alone (as next() does), `token_id` on the host when known; what feeding it evicted."""
        return self._feed(token, token_id)

    def checkpoint(self) -> None:
        """Before a batch feeds this decoder's token: what take_back() returns to."""
        self._checkpoint, self._previous_row = CacheSnapshot.take(self.cache), self._row

    def fed(self, logits: torch.Tensor) -> None:
        """A batch fed this decoder's token: `logits` [1, 1, vocab] are its row's, the next token is drawn from them."""
        self._row = self._last_row(logits)

    def draw_agreed(self, stop_requested: bool) -> Settled | None:
        """draw() as every rank agrees on it: under tensor parallelism the leader draws and the others are told.
        None where the reply stops instead (`stop_requested`: the leader's, under a channel)."""
        if self.channel is None:
            return None if stop_requested else self.draw()
        token = self.draw().token if self.channel.leads and not stop_requested else None
        token = self.channel.share_token(token)
        if token is None:
            return None
        return Settled(token, torch.tensor([token], device=self.device), redrawn=False)

    def _next_in_lockstep(self, stop_requested: bool) -> Decoded | None:
        """The leader draws (settled on the host) and shares; every rank feeds the same token."""
        settled = self.draw_agreed(stop_requested)
        if settled is None:
            return None
        return Decoded(settled.token, self._feed(settled.on_device, settled.token))

    def take_back(self) -> None:
        """Undo the step that fed the last token (exactly: nothing it overwrote was held), its count included."""
        self._restore()
        if self._counted is not None:
            self._counts.index_add_(0, self._counted, self._one, alpha=-1)
            self._counted = None

    def _restore(self) -> None:
        self._checkpoint.restore(self.cache)
        self._row = self._previous_row

    # ---- the phases of a step ----------------------------------------------------------

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

    def _count(self, token: torch.Tensor) -> None:
        """Token [1], settled, is the reply's next: the frequency and presence penalties count it from now on."""
        if self._counts is not None:
            self._counts.index_add_(0, token, self._one)  # on the device: no host sync
            self._counted = token

    def _feed(self, token: torch.Tensor, token_id: int = UNREAD) -> Eviction | None:
        """Feed token [1] (`token_id` on the host, UNREAD when not read yet) through the cache; keep the logits
        after it, return what feeding it evicted."""
        cache = self.cache
        self.checkpoint()
        token = token.reshape(1, 1)
        if not cache.ledger.sinks_full:
            logits, eviction = forward(self.model, cache, token, label=self.label)  # it records the id itself
            self._row = self._last_row(logits)
            return eviction
        with cache.decode_step(self.label, token_id) as eviction:
            logits = self._compiled_call(token) if self.compiled else self._step_fn(self.model, cache, token)
            self._row = self._last_row(logits)
        return eviction

    def _compiled_call(self, token: torch.Tensor) -> torch.Tensor:
        if self.compile_seconds is not None:
            _mark_graph_step(self.device)
            return self._step_fn(self.model, self.cache, token)
        self.cache.mark_static()
        started = time.perf_counter()
        logits = self._step_fn(self.model, self.cache, token)
        self.compile_seconds = time.perf_counter() - started
        return logits


class _Reader:
    """Token ids back to the host: on CUDA through pinned memory and an event, so only the token is waited for."""

    def __init__(self, device: torch.device) -> None:
        self.asynchronous = device.type == "cuda"
        self._values: torch.Tensor | None = None
        if self.asynchronous:
            self._host = torch.empty(2, dtype=torch.long, pin_memory=True)
            self._ready = torch.cuda.Event()

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
            token, settled = self._values.tolist()
        return token, bool(settled)


def compile_backend(setting: str, device: torch.device) -> str | None:
    """What --compile auto|on|off means on `device`: a torch.compile backend, or None for eager steps.

    auto compiles on CUDA, where a step is thousands of kernel launches that CUDA graphs
    replay at once. Not on the CPU, as measured (README, Benchmarks): the compiled lean step
    of the default model is 5 % faster at a full cache (16.3 against 17.2 ms a token) and
    slower with a short prompt, and the first start compiles for 47 s on two cores, which a
    chat wins back only after about 50,000 tokens.
    """
    if setting not in defaults.COMPILE_SETTINGS:
        raise ConfigError(f"--compile {setting!r}: choose one of {', '.join(defaults.COMPILE_SETTINGS)}")
    if setting == "auto":
        return "inductor" if device.type == "cuda" else None
    return "inductor" if setting == "on" else None


def _compiled_step(device: torch.device, backend: str, step: Any) -> Any:
    """A decode step compiled to one graph: with CUDA graphs on a GPU, where launching kernels one by one costs."""
    mode = "reduce-overhead" if device.type == "cuda" and backend == "inductor" else None
    return torch.compile(step, backend=backend, mode=mode, fullgraph=True, dynamic=False)


def _mark_graph_step(device: torch.device) -> None:
    if device.type == "cuda":
        # Tells CUDA graph trees that the last step's outputs are done with, so the next replay may reuse them.
        torch.compiler.cudagraph_mark_step_begin()
