"""Engine: every conversation's next forward pass, run together, one step at a time.

    engine = Engine(model)     # or Engine(model, compile_backend="inductor"): a reply alone steps compiled
    engine.submit(request)     # a reply to decode, a text to read: it works in every step until it ends
    outputs = engine.step()    # draw -> schedule -> run -> settle: what it did for each request (Output)
    engine.leave(cache)        # a conversation stopped waiting: its request, work and row go
    engine.reserve(rows, like) # the decode batch grown for that many replies now, not as they start

One step is one forward pass (nano-vllm's LLMEngine.step), in four phases:

    draw        each request's next work: a reply's token, drawn with its own settings and seed; a text's next
                chunk (Request.next_work)
    schedule    the replies' tokens, then text chunks up to a token budget (engine/scheduler.py)
    run         all of them in one forward pass (Runner, below)
    settle      each reply's token detokenized and checked for a stop, each chunk's eviction and progress noted
                (Request.advance)

A reply's token is drawn at the start of the step that feeds it, not at the end of the one
before, so a stop asked for between two steps (Ctrl-C, a client gone) is heeded before
another token is drawn (a text's chunk likewise). What the requests say comes back from the
step, an Output each, for the process's driver to hand on (streamchat.generation.driver).

Decoding is bound by reading the weights, so a step for eight conversations costs little
more than a step for one, and a prompt chunk read in the same pass shares the reads.

The run phase is the one place a step's work meets the model (Runner). Decode rows feed
through the batch of streamchat.cache.batch (each cache a row of one allocation, its own
ledgers planning its pass); each prompt chunk through its own cache's forward pass. Where
the model has the lean forward (placement/lean_forward.py, the llama family fused at load),
all of them run as one ragged pass: the products read every weight once for the whole
step. Other models run the decode rows in one pass and each chunk in its own, through the
model's forward: the same results, more weight reads. With a compile backend, a reply
decoding alone steps through its compiled step (engine/compiled_decode.py): the chat's,
one conversation a step.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, NamedTuple, TypeVar

import torch

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.cache.batch import BatchPass, CacheBatch
from streamchat.cache.feeding import model_logits
from streamchat.cache.sink_cache import ForwardPass
from streamchat.engine.compiled_decode import CompiledDecode
from streamchat.engine.scheduler import Scheduled, schedule
from streamchat.engine.work import DecodeRow, Fed, Output, PromptChunk, Request, Ticket
from streamchat.errors import CacheStateError
from streamchat.placement.lean_forward import LeanForward, Segment, lean_forward_for

_Kind = TypeVar("_Kind", DecodeRow, PromptChunk)


class Engine:
    """The requests of every conversation over one model, and the steps that run them."""

    def __init__(
        self, model: Any, token_budget: int = defaults.STEP_TOKEN_BUDGET, compile_backend: str | None = None
    ) -> None:
        self.runner = Runner(model, compile_backend)
        self.token_budget = token_budget
        self._queued: list[Ticket] = []  # work drawn and not yet run (a chunk past a step's budget waits here)
        # Every request going on, in the order they came, but those whose work is queued: each waits here for its
        # next work's draw.
        self._drawing: list[Request] = []
        self.steps = 0  # steps run
        self.rows_fed = 0  # decode tokens they fed
        self.chunk_tokens = 0  # text tokens they read

    def submit(self, request: Request) -> None:
        """Work on `request` from the coming step on, each step, until it ends."""
        self._drawing.append(request)

    def has_work(self) -> bool:
        return bool(self._queued or self._drawing)

    def step(self) -> list[Output]:
        """Run the next step: draw, schedule, one forward pass, settle. What it did for each request it touched, in
        the order they came: what each said and whether it ended (one that ended at its draw, a stop asked for,
        too); none when nothing was left to run.

        A failure of the pass (out of memory, a bug) reaches every request of the step: each ends with it, its
        conversation hears of it, and the engine goes on without them.
        """
        outputs = self._draw()
        scheduled = schedule(self._queued, self.runner.members, self.token_budget)
        if not scheduled:
            return outputs
        tickets = scheduled.tickets
        running = {id(ticket.request) for ticket in tickets}
        self._queued = [ticket for ticket in self._queued if id(ticket.request) not in running]
        try:
            outcomes: list[Fed | BaseException] = list(self.runner.run(scheduled))
        except Exception as error:
            outcomes = [error] * len(tickets)
        else:
            self.steps += 1
            self.rows_fed += len(scheduled.rows)
            self.chunk_tokens += sum(ticket.work.tokens for ticket in scheduled.chunks)
        outputs += [self._settle(ticket.request, outcome) for ticket, outcome in zip(tickets, outcomes, strict=True)]
        return outputs

    def reserve(self, rows: int, like: SinkCache) -> None:
        """Room in the decode batch for `rows` replies whose caches are laid out as `like`, now (a server's start)."""
        self.runner.batch.reserve(rows, like)

    def leave(self, cache: SinkCache) -> None:
        """`cache`'s conversation stopped (its request ended, or was abandoned): its request and queued work are
        dropped and it leaves the batch."""
        self._queued = [ticket for ticket in self._queued if ticket.work.cache is not cache]
        self._drawing = [request for request in self._drawing if request.cache is not cache]
        self.runner.leave(cache)

    # ---- the phases of a step ----------------------------------------------------------------

    def _draw(self) -> list[Output]:
        """Each request's next work, queued for this step; the outputs of those that end before it."""
        drawing, self._drawing = self._drawing, []
        ended = []
        for request in drawing:
            try:
                work = request.next_work()
            except Exception as error:  # its sampler failed (out of memory): that request fails, the rest go on
                ended.append(self._end(request, error))
                continue
            if work is None:
                ended.append(self._end(request))
            else:
                self._queued.append(Ticket(work, request))
        return ended

    def _settle(self, request: Request, outcome: Fed | BaseException) -> Output:
        if isinstance(outcome, BaseException):
            return self._end(request, outcome)
        try:
            advanced = request.advance(outcome)
        except Exception as error:
            return self._end(request, error)
        if advanced.goes_on:
            self._drawing.append(request)
            return Output(request, advanced.events)
        return self._end(request, events=advanced.events)

    def _end(self, request: Request, error: BaseException | None = None, events: tuple[object, ...] = ()) -> Output:
        """A request ended: a reply leaves the batch now, between steps, so the next step's rows need no word
        from it."""
        self.runner.leave(request.cache)
        request.end(error)
        return Output(request, events, ended=True, error=error)


# ---- the run phase ----------------------------------------------------------------------------


class _Rows(NamedTuple):
    """The decode rows' open pass, and the cache they attend through (the batch, or one reply's own cache)."""

    cache: CacheBatch | SinkCache
    opened: BatchPass


class Runner:
    """The run phase: a step's scheduled work fed through one model, in one forward pass where it can be.

    runner = Runner(model)               # or Runner(model, compile_backend="inductor")
    outcomes = runner.run(scheduled)     # a Fed for each ticket, in scheduled.tickets' order
    runner.leave(cache)                  # a reply ended: its cache owns its storage again
    """

    def __init__(self, model: Any, compile_backend: str | None = None) -> None:
        self.model = model
        self.lean = lean_forward_for(model)
        self.batch = CacheBatch()
        self.compiled = CompiledDecode(model, compile_backend) if compile_backend is not None else None

    @property
    def members(self) -> list[SinkCache]:
        """The caches in the decode batch, in row order."""
        return self.batch.members

    def run(self, scheduled: Scheduled) -> list[Fed]:
        """Feed every scheduled piece of work; what each got, in `scheduled.tickets`' order."""
        rows, chunks = _works(scheduled.rows, DecodeRow), _works(scheduled.chunks, PromptChunk)
        compiled, lean = self.compiled, self.lean
        if compiled is not None and len(rows) == 1 and not chunks and not self.batch.members:
            return [self._compiled_decode(compiled, rows[0])]
        with torch.inference_mode(), ExitStack() as opened:
            decode = self._open_rows(rows, opened) if rows else None
            reads = [opened.enter_context(chunk.cache.forward_pass(chunk.ids, chunk.label)) for chunk in chunks]
            if lean is not None:
                logits = self._ragged(lean, decode, chunks, reads)
            else:
                logits = self._each(decode, chunks, reads)
        evictions = [*(decode.opened.evictions if decode is not None else []), *(read.eviction for read in reads)]
        return [Fed(row[None, None], eviction) for row, eviction in zip(logits, evictions, strict=True)]

    def leave(self, cache: SinkCache) -> None:
        """`cache`'s reply ended, between steps: it leaves the decode batch. A last member left alone leaves
        too (one copy of its cache): one reply decodes through its own cache, as fast as a reply alone."""
        with torch.inference_mode():
            self.batch.leave(cache)
            if len(self.batch.members) == 1:
                self.batch.leave(self.batch.members[0])

    def will_compile(self, cache: SinkCache) -> bool:
        """Whether a step that decodes `cache` alone compiles first (slow: the chat says so)."""
        return self.compiled is not None and self.compiled.will_compile(cache)

    def _compiled_decode(self, compiled: CompiledDecode, row: DecodeRow) -> Fed:
        with row.cache.decode_pass(row.label, row.token_id) as eviction:
            return Fed(compiled(row.cache, row.token.reshape(1, 1)), eviction)

    def _open_rows(self, rows: list[DecodeRow], opened: ExitStack) -> _Rows:
        """Open the decode rows' pass: one reply alone through its own cache's decode pass, more through the batch."""
        if len(rows) == 1 and not self.batch.members:
            row = rows[0]
            cache, token = row.cache, row.token.reshape(1, 1)
            eviction = opened.enter_context(cache.decode_pass(row.label, row.token_id))
            return _Rows(cache, BatchPass(token, cache.decode_inputs(token), [eviction]))
        self.batch.join(*(row.cache for row in rows))  # members stay; joiners take the next rows, in order
        tokens, labels, token_ids = zip(*((row.token, row.label, row.token_id) for row in rows), strict=True)
        return _Rows(self.batch, opened.enter_context(self.batch.decode_pass(tokens, labels, token_ids)))

    def _ragged(
        self, lean: LeanForward, decode: _Rows | None, chunks: list[PromptChunk], reads: list[ForwardPass]
    ) -> torch.Tensor:
        """One lean pass (`lean`, the model's) over every row and chunk: logits [outputs, vocab]."""
        if not chunks:  # decode rows only: the lean decode pass as it is (rows of one token, no segments to cut)
            if decode is None:
                raise CacheStateError("a step was run with no work in it")
            inputs = decode.opened.inputs
            return lean(decode.opened.input_ids, inputs.position_ids, inputs.attention_mask, decode.cache)[:, -1]
        tokens, positions, segments = [], [], []
        if decode is not None:
            rows = decode.opened
            tokens.append(rows.input_ids[:, 0])  # [rows]: one a member
            positions.append(rows.inputs.position_ids[:, 0])
            segments.append(Segment(len(tokens[0]), decode.cache, rows.inputs.attention_mask, decode=True))
        for chunk, read in zip(chunks, reads, strict=True):
            tokens.append(chunk.ids[0])
            positions.append(read.inputs.position_ids[0])
            segments.append(Segment(chunk.tokens, chunk.cache, read.inputs.attention_mask, decode=False))
        return lean.ragged(torch.cat(tokens), torch.cat(positions), segments)[0]

    def _each(self, decode: _Rows | None, chunks: list[PromptChunk], reads: list[ForwardPass]) -> torch.Tensor:
        """The model's own forward: the decode rows in one pass, then each chunk in its own; [outputs, vocab]."""
        parts = [] if decode is None else [(decode.opened.input_ids, decode.cache, decode.opened.inputs)]
        parts += [(chunk.ids, chunk.cache, read.inputs) for chunk, read in zip(chunks, reads, strict=True)]
        return torch.cat([model_logits(self.model, cache, ids, inputs)[:, -1] for ids, cache, inputs in parts])


def _works(tickets: list[Ticket], kind: type[_Kind]) -> list[_Kind]:
    """The work of `tickets`, each piece a `kind`: the scheduler sorts decode rows from prompt chunks."""
    works = []
    for ticket in tickets:
        if not isinstance(ticket.work, kind):
            raise CacheStateError(f"a step's {kind.__name__}s hold a {type(ticket.work).__name__}")
        works.append(ticket.work)
    return works
