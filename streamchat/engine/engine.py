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
    run         all of them in one forward pass (engine/runner.py)
    settle      each reply's token detokenized and checked for a stop, each chunk's eviction and progress noted
                (Request.advance)

A reply's token is drawn at the start of the step that feeds it, not at the end of the one
before, so a stop asked for between two steps (Ctrl-C, a client gone) is heeded before
another token is drawn (a text's chunk likewise). What the requests say comes back from the
step, an Output each, for the process's driver to hand on (streamchat.generation.driver).

Decoding is bound by reading the weights, so a step for eight conversations costs little
more than a step for one, and a prompt chunk read in the same pass shares the reads.
"""

from __future__ import annotations

from typing import Any

from streamchat import defaults
from streamchat.cache import SinkCache
from streamchat.engine.runner import Runner
from streamchat.engine.scheduler import schedule
from streamchat.engine.work import Fed, Output, Request, Ticket


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
