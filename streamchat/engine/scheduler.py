"""Which queued work the next step runs: every decoding reply's token, then prompt chunks up to a token budget.

vLLM's chunked prefill, in small: decode rows go first (a reply's next token is never held
back by another conversation's prompt), then whole chunks in the order they were queued
while the step's tokens stay within the budget. The oldest chunk always goes, whatever its
length, so a prompt is never starved by decode rows. Chunks are never cut further here:
a conversation cuts its prompt where reading it alone would, so the cache computes the same.

Decode rows run together or not at all: the batched decode step feeds every member of the
batch at once, so it waits until every member has queued its token (each does, once per
round of the engine's clients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from streamchat.cache import SinkCache
from streamchat.engine.work import DecodeRow, PromptChunk, Ticket


@dataclass
class Scheduled:
    """One step's work: decode rows in the batch's row order (joiners last), then prompt chunks."""

    rows: list[Ticket] = field(default_factory=list)
    chunks: list[Ticket] = field(default_factory=list)

    @property
    def tickets(self) -> list[Ticket]:
        return [*self.rows, *self.chunks]

    def __bool__(self) -> bool:
        return bool(self.rows or self.chunks)


def schedule(queued: Sequence[Ticket], members: Sequence[SinkCache], token_budget: int) -> Scheduled:
    """The next step's work out of `queued` (oldest first), for a batch whose rows are `members`."""
    rows = {id(ticket.work.cache): ticket for ticket in queued if isinstance(ticket.work, DecodeRow)}
    step = Scheduled()
    if rows and all(id(member) in rows for member in members):
        step.rows = [rows.pop(id(member)) for member in members] + list(rows.values())
    budget = token_budget - len(step.rows)
    for ticket in queued:
        if not isinstance(ticket.work, PromptChunk):
            continue
        if step.chunks and ticket.work.tokens > budget:
            break  # first come, first read: a later, shorter chunk does not overtake it
        step.chunks.append(ticket)
        budget -= ticket.work.tokens
    return step
