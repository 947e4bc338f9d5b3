"""Engine: every conversation's next forward pass, run together, one step at a time.

    engine = Engine(model)
    ticket = engine.queue(DecodeRow(cache, token))     # or PromptChunk(cache, ids): from each conversation
    engine.step()                                      # schedule -> run -> settle every ticket it ran
    fed = ticket.result()                              # the logits after it, what it evicted
    engine.leave(cache)                                # a reply ended: its row leaves the decode pool

One step is one forward pass (nano-vllm's LLMEngine.step): the scheduler picks every
decoding reply's token and prompt chunks up to a token budget (engine/scheduler.py), the
runner feeds them together (engine/runner.py), and each ticket gets its row's logits. What
the logits become (a token drawn with the reply's own settings and seed, text, a stop) is
the conversation's business, done between steps (streamchat.generation), so the engine
holds no state of any conversation beyond its pool row.

Decoding is bound by reading the weights, so a step for eight conversations costs little
more than a step for one, and a prompt chunk read in the same pass shares the reads.
"""

from __future__ import annotations

from typing import Any

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.engine.runner import Runner
from streamchat.engine.scheduler import schedule
from streamchat.engine.work import Ticket, Work


class Engine:
    """The queue of every conversation's next piece of work over one model, and the steps that run it."""

    def __init__(self, model: Any, token_budget: int = defaults.STEP_TOKEN_BUDGET) -> None:
        self.runner = Runner(model)
        self.token_budget = token_budget
        self._queued: list[Ticket] = []
        self.steps = 0  # steps run
        self.rows_fed = 0  # decode tokens they fed
        self.chunk_tokens = 0  # prompt tokens they read

    def queue(self, work: Work) -> Ticket:
        """Ask for `work` in a coming step; its ticket settles when a step ran it."""
        ticket = Ticket(work)
        self._queued.append(ticket)
        return ticket

    def withdraw(self, ticket: Ticket) -> None:
        """Take back work not yet run (its conversation stopped waiting for it)."""
        self._queued = [queued for queued in self._queued if queued is not ticket]

    def has_work(self) -> bool:
        return bool(self._queued)

    def step(self) -> bool:
        """Run the next step: schedule, one forward pass, settle its tickets; False when nothing could run.

        A failure (out of memory, a bug) settles every ticket of the step with it: each
        conversation waiting on one hears of it, and the engine goes on without them.
        """
        scheduled = schedule(self._queued, self.runner.members, self.token_budget)
        if not scheduled:
            return False
        tickets = scheduled.tickets
        running = {id(ticket) for ticket in tickets}
        self._queued = [ticket for ticket in self._queued if id(ticket) not in running]
        try:
            outcomes = self.runner.run(scheduled)
        except Exception as error:
            for ticket in tickets:
                ticket.settle(error)
            return True
        for ticket, outcome in zip(tickets, outcomes, strict=True):
            ticket.settle(outcome)
        self.steps += 1
        self.rows_fed += len(scheduled.rows)
        self.chunk_tokens += sum(ticket.work.tokens for ticket in scheduled.chunks)
        return True

    def leave(self, cache: SinkCache) -> None:
        """`cache`'s reply ended (or was abandoned): its queued work is dropped and it leaves the pool."""
        self._queued = [ticket for ticket in self._queued if ticket.work.cache is not cache]
        self.runner.leave(cache)
