"""The one place a step's work meets the model: decode rows and prompt chunks in one forward pass.

    runner = Runner(model)               # or Runner(model, compile_backend="inductor")
    outcomes = runner.run(scheduled)     # a Fed for each ticket, in scheduled.tickets' order
    runner.leave(cache)                  # a reply ended: its cache owns its storage again

Decode rows feed through the batch of streamchat.cache.batch (each cache a row of one
allocation, its own ledgers planning its pass); each prompt chunk through its own cache's
forward pass. Where the model has the lean forward (placement/lean_forward.py, the llama family
fused at load), all of them run as one ragged pass: the products read every weight once
for the whole step. Other models run the decode rows in one pass and each chunk in its own,
through the model's forward: the same results, more weight reads. With a compile backend,
a reply decoding alone steps through its compiled step (engine/compiled_decode.py): the
chat's, one conversation a step.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any, NamedTuple, TypeVar

import torch

from streamchat.cache.batch import BatchPass, CacheBatch
from streamchat.cache.feeding import model_logits
from streamchat.cache.sink_cache import ForwardPass, SinkCache
from streamchat.engine.compiled_decode import CompiledDecode
from streamchat.engine.scheduler import Scheduled
from streamchat.engine.work import DecodeRow, Fed, PromptChunk, Ticket
from streamchat.errors import CacheStateError
from streamchat.placement.lean_forward import LeanForward, Segment, lean_forward_for

_Kind = TypeVar("_Kind", DecodeRow, PromptChunk)


class _Rows(NamedTuple):
    """The decode rows' open pass, and the cache they attend through (the batch, or one reply's own cache)."""

    cache: CacheBatch | SinkCache
    opened: BatchPass


class Runner:
    """Runs scheduled steps over one model."""

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
