"""Engine: every conversation's next forward pass, run together, one step at a time.

    engine = Engine(model)
    engine.submit(reply)                               # a reply decodes in every step until it ends
    ticket = engine.queue(PromptChunk(cache, ids))     # or one piece of work: a prompt chunk
    engine.step()                                      # draw -> schedule -> run -> settle
    fed = ticket.result()                              # the logits after it, what it evicted
    engine.leave(cache)                                # a conversation stopped waiting: its work and row go

One step is one forward pass (nano-vllm's LLMEngine.step), in four phases:

    draw        every decoding reply's next token, with its own settings and seed (Decoding.next_work)
    schedule    those tokens, then prompt chunks up to a token budget (engine/scheduler.py)
    run         all of them in one forward pass (engine/runner.py)
    settle      each reply's token detokenized and checked for a stop (Decoding.advance); each ticket filled

A reply's token is drawn at the start of the step that feeds it, not at the end of the one
before, so a stop asked for between two steps (Ctrl-C, a client gone) is heeded before
another token is drawn. What the replies say waits in each one for whoever drives the steps
to hand on (streamchat.generation.engine_steps).

Decoding is bound by reading the weights, so a step for eight conversations costs little
more than a step for one, and a prompt chunk read in the same pass shares the reads.
"""

from __future__ import annotations

from typing import Any

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.engine.runner import Runner
from streamchat.engine.scheduler import schedule
from streamchat.engine.work import Decoding, Fed, Ticket, Work


class Engine:
    """The decoding replies and queued work of every conversation over one model, and the steps that run them."""

    def __init__(self, model: Any, token_budget: int = defaults.STEP_TOKEN_BUDGET) -> None:
        self.runner = Runner(model)
        self.token_budget = token_budget
        self._queued: list[Ticket] = []
        # Every reply decoding, in the order they came: between steps, each waits here for its next token's draw
        # (within a step, its token is a queued ticket's work).
        self._drawing: list[Decoding] = []
        self.steps = 0  # steps run
        self.rows_fed = 0  # decode tokens they fed
        self.chunk_tokens = 0  # prompt tokens they read

    def submit(self, reply: Decoding) -> None:
        """Decode `reply` from the coming step on, a token each step, until it ends."""
        self._drawing.append(reply)

    def queue(self, work: Work) -> Ticket:
        """Ask for `work` in a coming step; its ticket settles when a step ran it."""
        ticket = Ticket(work)
        self._queued.append(ticket)
        return ticket

    def withdraw(self, ticket: Ticket) -> None:
        """Take back work not yet run (its conversation stopped waiting for it)."""
        self._queued = [queued for queued in self._queued if queued is not ticket]

    def has_work(self) -> bool:
        return bool(self._queued or self._drawing)

    def step(self) -> bool:
        """Run the next step: draw, schedule, one forward pass, settle; False when nothing could run.

        A failure of the pass (out of memory, a bug) reaches every reply and ticket of the step:
        each conversation waiting on one hears of it, and the engine goes on without them.
        """
        self._draw()
        scheduled = schedule(self._queued, self.runner.members, self.token_budget)
        if not scheduled:
            return False
        tickets = scheduled.tickets
        running = {id(ticket) for ticket in tickets}
        self._queued = [ticket for ticket in self._queued if id(ticket) not in running]
        try:
            outcomes: list[Fed | BaseException] = list(self.runner.run(scheduled))
        except Exception as error:
            outcomes = [error] * len(tickets)
        else:
            self.steps += 1
            self.rows_fed += len(scheduled.rows)
            self.chunk_tokens += sum(ticket.work.tokens for ticket in scheduled.chunks)
        for ticket, outcome in zip(tickets, outcomes, strict=True):
            self._settle(ticket, outcome)
        return True

    def leave(self, cache: SinkCache) -> None:
        """`cache`'s conversation stopped (its reply ended, or was abandoned): its reply and queued work are dropped
        and it leaves the pool."""
        self._queued = [ticket for ticket in self._queued if ticket.work.cache is not cache]
        self._drawing = [reply for reply in self._drawing if reply.cache is not cache]
        self.runner.leave(cache)

    # ---- the phases of a step ----------------------------------------------------------------

    def _draw(self) -> None:
        """Each decoding reply's next token, as a piece of work queued for this step."""
        drawing, self._drawing = self._drawing, []
        for reply in drawing:
            try:
                work = reply.next_work()
            except Exception as error:  # its sampler failed (out of memory): that reply fails, the rest go on
                self._end(reply, error)
                continue
            if work is None:
                self._end(reply)
            else:
                self._queued.append(Ticket(work, reply))

    def _settle(self, ticket: Ticket, outcome: Fed | BaseException) -> None:
        reply = ticket.reply
        if reply is None:
            ticket.settle(outcome)
            return
        if isinstance(outcome, BaseException):
            self._end(reply, outcome)
            return
        try:
            goes_on = reply.advance(outcome)
        except Exception as error:
            self._end(reply, error)
            return
        if goes_on:
            self._drawing.append(reply)
        else:
            self._end(reply)

    def _end(self, reply: Decoding, error: BaseException | None = None) -> None:
        """A reply ended: it leaves the pool now, between steps, so the next step's rows need no word from it."""
        self.runner.leave(reply.cache)
        reply.end(error)
