"""The one thread that owns the model: it runs every request's turn, and the engine's steps.

Requests hand it their turns (streamchat.serve.turn). Each round it moves every turn on to
the point where it waits for the engine (a prompt or a replayed message to read, a reply to
decode: a request submitted), runs the engine's step (streamchat.engine: every reply's next
token drawn, the prompt chunks a token budget allows, one forward pass, each reply's token
detokenized and checked for a stop), then hands each decoding reply's text to its request
straight from the reply: a turn is resumed only once its engine request ended, not for every
token or chunk. Concurrent replies cost little more than one, and a new message is read in
the pass that decodes the others. Each item goes to its request through `deliver` (the
request's asyncio queue, via call_soon_threadsafe).
At most `max_jobs` turns are admitted at once, waiting or running; past that, submit() says no
(the request gets 429). A turn whose client left while it waited for a live session ends
there. Closing stops every reply, lets each turn journal what it said, then parks every live
conversation (its state written beside its journal).

It is the only thread that runs torch: it loads the model too (start(prepare)). A CPU step run
from one thread after another had run torch's parallel regions took twice as long (18-21 ms a
token for the default model from the thread that loaded it, 34-40 from a second one: two
OpenMP thread pools on the same cores), which halved the server's decode speed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import suppress
from dataclasses import dataclass

from streamchat.generation.engine_steps import DecodingReply, Waiting
from streamchat.generation.events import TextDelta
from streamchat.generation.prompt_reading import Reading
from streamchat.serve.openai_api import ApiError
from streamchat.serve.pool import ConversationPool, Step
from streamchat.serve.turn import Delta, Turn

log = logging.getLogger("streamchat.serve")

# What a turn's end is delivered as, after its last item.
END = None
# How long the worker sleeps when every turn waits for a live session.
WAITING_POLL_SECONDS = 0.005


@dataclass(eq=False)
class Job:
    turn: Turn
    deliver: Callable[[object], None]  # Started, Delta, Finished, an ApiError, then END


@dataclass(eq=False)
class _Running:
    """A turn under way: its items, and the engine request it waits on (a reply decoding, a text being read)."""

    job: Job
    items: Iterator[object]
    awaited: DecodingReply | Reading | None = None


class Worker:
    def __init__(self, max_jobs: int) -> None:
        self.max_jobs = max_jobs
        self._condition = threading.Condition()
        self._incoming: list[Job] = []
        self._jobs: set[Job] = set()
        self._closing = False
        self._thread = threading.Thread()  # replaced by start()
        self._running = threading.Event()  # set once `prepare` returned: the thread runs turns

    def start(self, prepare: Callable[[], ConversationPool]) -> ConversationPool:
        """Start the thread that owns the model: `prepare` builds the pool there (loading the model), then the
        thread runs every turn. The pool, or what `prepare` raised."""
        ready: Future[ConversationPool] = Future()
        self._thread = threading.Thread(target=self._own, args=(prepare, ready), name="streamchat-worker", daemon=True)
        self._thread.start()
        return ready.result()

    @property
    def closing(self) -> bool:
        return self._closing

    def submit(self, job: Job) -> bool:
        """Admit `job`; False when `max_jobs` are already admitted (or the worker is closing)."""
        with self._condition:
            if self._closing or len(self._jobs) >= self.max_jobs:
                return False
            self._jobs.add(job)
            self._incoming.append(job)
            self._condition.notify()
            return True

    def stop_all(self) -> None:
        """Every reply ends within a step (safe from a signal handler: it only sets flags)."""
        for job in list(self._jobs):
            job.turn.stop()

    def close(self) -> None:
        """Stop every reply, finish every turn, park every live conversation; then the thread ends."""
        with self._condition:
            self._closing = True
            self._condition.notify()
        self.stop_all()
        if self._running.is_set():  # not while it still loads (Ctrl-C then): that thread dies with the process
            self._thread.join()

    def _own(self, prepare: Callable[[], ConversationPool], ready: Future[ConversationPool]) -> None:
        try:
            pool = prepare()
        except BaseException as error:  # the caller of start() says it (a model that cannot load, ...)
            ready.set_exception(error)
            return
        self._running.set()
        ready.set_result(pool)
        self._run(pool)

    def _run(self, pool: ConversationPool) -> None:
        running: list[_Running] = []
        try:
            while True:
                with self._condition:
                    running += [_Running(job, job.turn.run()) for job in self._incoming]
                    self._incoming.clear()
                    if not running:
                        if self._closing:
                            break
                        self._condition.wait()
                        continue
                if self._closing:
                    self.stop_all()
                waiting = [self._advance(turn) for turn in running]
                running = [turn for turn, state in zip(running, waiting, strict=True) if state is not None]
                engine = pool.served.engine
                if engine is not None and engine.has_work():
                    engine.step()  # what the turns queued this round, and every reply's next token, in one pass
                for turn in running:
                    if turn.awaited is not None:
                        self._hand_on(turn)
                if running and all(waiting):
                    with self._condition:
                        self._condition.wait(WAITING_POLL_SECONDS)
        finally:
            pool.park_all()

    def _advance(self, turn: _Running) -> bool | None:
        """Move `turn` on (its items delivered on the way): True when it waits for a session, False when it
        worked or waits for the engine, None when it ended."""
        if turn.awaited is not None:  # in the engine: the turn goes on when its request ended
            turn.job.turn.heed_stop()
            return False
        job = turn.job
        while True:
            try:
                item = next(turn.items)
            except StopIteration:
                return self._end(job, END)
            except ApiError as error:
                return self._end(job, error)
            except Exception as error:  # a bug or a failure in the engine: that request fails, the server goes on
                log.exception("a request failed")
                return self._end(job, ApiError(500, f"the reply failed: {error}", kind="server_error"))
            if isinstance(item, Waiting):
                turn.awaited = item.request
                return False
            if isinstance(item, Step):
                if item.waiting and job.turn.stopped:  # its client left before the turn began: it ends here
                    turn.items.close()
                    return self._end(job, END)
                return item.waiting
            _deliver(job, item)

    def _hand_on(self, turn: _Running) -> None:
        """A step ran: the text a reply said goes to the request; the turn goes on once its engine request ended
        (and hears of what ended it, where a failure did)."""
        for event in turn.awaited.said():
            if isinstance(event, TextDelta):
                _deliver(turn.job, Delta(event.text))
        if turn.awaited.ended:
            turn.awaited = None

    def _end(self, job: Job, last: object) -> None:
        if last is not END:
            _deliver(job, last)
        _deliver(job, END)
        with self._condition:
            self._jobs.discard(job)
        return None


def _deliver(job: Job, item: object) -> None:
    with suppress(RuntimeError):  # the request's event loop is gone (the server stopped): nobody to tell
        job.deliver(item)
