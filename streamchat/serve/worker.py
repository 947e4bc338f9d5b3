"""The one thread that owns the model: it runs every request's turn, and the engine's steps.

Requests hand it their turns (streamchat.serve.turn), which it runs as tasks of the process's
driver (streamchat.generation.driver). Each round the driver moves every turn on to the point
where it waits for the engine (a prompt or a replayed message to read, a reply to decode: a
request submitted), runs the engine's step (every reply's next token drawn, the prompt
chunks a token budget allows, one forward pass, each reply's token detokenized and checked
for a stop), and hands each step's text to the request whose reply said it, straight from
the step: a turn is resumed only once its engine request ended, not for every token or
chunk. Concurrent replies cost little more than one, and a new message is read in the pass
that decodes the others. Each item goes to its request through `deliver` (the request's
asyncio queue, via call_soon_threadsafe).
At most `max_jobs` turns are admitted at once, running or waiting in line, first come first
served; past that, submit() says no (the request gets 429). A turn that needs a live
conversation while every one is answering waits in line until a turn ends, and starts again
then (it had done nothing yet); one that waited `max_wait_seconds` gets 429 instead, and one
whose client left while it waited ends there, leaving nothing behind.
Closing stops every reply, lets each turn journal what it said, then parks every live
conversation (its state written beside its journal).

It is the only thread that runs torch: it loads the model too (start(prepare)). A CPU step run
from one thread after another had run torch's parallel regions took twice as long (18-21 ms a
token for the default model from the thread that loaded it, 34-40 from a second one: two
OpenMP thread pools on the same cores), which halved the server's decode speed.

A request's route runs its turn through the worker and reads its items back on its own event loop:

    async with running_turn(worker, pool, request, chat) as running:  # ApiError: 429, 503, or the turn's own
        headers = running.headers                                     # X-Streamchat-Conversation, -Cache, -Warning
        finished, logprobs = await running.finished()                 # a whole reply
    async with aclosing(running.items()) as items:                    # or a streamed one, in the route's response
        async for item in items: ...                                  # TextDelta, TokenLogprob..., then Finished

Every API (OpenAI's chat completions and Responses, Anthropic's Messages) reads its request
into a ChatRequest and formats what this reads: the turn, the conversation matching, the
journal and the waiting line are the same for all. Until the route returns, a client that
goes away stops the turn (it was sent none of the reply); a stream watches for itself: a
client gone mid-stream stops the reply within a step, and the conversation is filed under
the text it was sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import Future
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from streamchat.cache.ledger import CacheStats
from streamchat.generation.events import TextDelta, TokenLogprob
from streamchat.serve.apis.request import ApiError, ChatRequest
from streamchat.serve.pool import NAMING_HEADER, ConversationPool, NoSessionFree
from streamchat.serve.turn import Finished, Started, Turn

log = logging.getLogger("streamchat.serve")

# What a turn's end is delivered as, after its last item.
END = None
_WAITED_TOO_LONG = "no conversation was free within {:g} s (--max-wait-seconds); try again shortly"
CACHE_HEADER = "X-Streamchat-Cache"
WARNING_HEADER = "X-Streamchat-Warning"


@dataclass(eq=False)
class Job:
    turn: Turn
    deliver: Callable[[object], object]  # Started, TextDelta, Finished, an ApiError, then END
    admitted: float = field(default_factory=time.monotonic)


class Worker:
    def __init__(self, max_jobs: int, max_wait_seconds: float | None = None) -> None:
        self.max_jobs = max_jobs
        self.max_wait_seconds = max_wait_seconds  # in line for a live conversation; None: as long as it takes
        self._condition = threading.Condition()
        self._incoming: list[Job] = []  # in line, first come first served
        self._session_wanted: list[Job] = []  # in line for a live conversation: back in line when a turn ends
        self._jobs: set[Job] = set()  # admitted: running or in line
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

    @property
    def admitted(self) -> int:
        """How many requests are admitted now: answered, or waiting in line."""
        return len(self._jobs)

    def submit(self, job: Job) -> bool:
        """Admit `job` (it runs once the turns before it leave room); False when `max_jobs` are already admitted
        (or the worker is closing)."""
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
        driver = pool.served.driver
        running: set[Job] = set()
        try:
            while True:
                with self._condition:
                    for job in self._incoming:
                        running.add(job)
                        driver.start(job.turn.run(), _handing_on(job), self._ending(job, running))
                    self._incoming.clear()
                    if not running:
                        if self._closing:
                            break
                        self._condition.wait()
                        continue
                if self._closing:
                    self.stop_all()
                for job in running:  # a stop asked for reaches a reply before its next token is drawn
                    job.turn.heed_stop()
                driver.round()  # what the turns queued this round, and every reply's next token, in one pass
                self._leave_line()
        finally:
            pool.park_all()

    def _leave_line(self) -> None:
        """Those in line for a live conversation whose client left, or who waited too long, leave it: told 429 (the
        first), or nothing (the second: nobody is listening)."""
        now = time.monotonic()
        limit = self.max_wait_seconds
        waited_out = [
            job
            for job in self._session_wanted
            if job.turn.stopped or (limit is not None and now - job.admitted > limit)
        ]
        for job in waited_out:
            self._session_wanted.remove(job)
            if not job.turn.stopped:
                _deliver(job, ApiError(429, _WAITED_TOO_LONG.format(limit), kind="rate_limit_error", code="busy"))
            _deliver(job, END)
            with self._condition:
                self._jobs.discard(job)

    def _ending(self, job: Job, running: set[Job]) -> Callable[[BaseException | None], None]:
        """What hears that `job`'s turn ended: its request is told how, and room is left for the next."""

        def ended(error: BaseException | None) -> None:
            running.discard(job)
            if isinstance(error, NoSessionFree) and not self._closing:
                self._session_wanted.append(job)
                return
            if isinstance(error, ApiError):
                _deliver(job, error)
            elif error is not None:  # a bug or a failure in the engine: that request fails, the server goes on
                log.error("a request failed", exc_info=error)
                _deliver(job, ApiError(500, f"the reply failed: {error}", kind="server_error"))
            _deliver(job, END)
            with self._condition:
                self._jobs.discard(job)
                # Its conversation is free now: those waiting for one start again, in the order they came.
                self._incoming[:0], self._session_wanted = self._session_wanted, []

        return ended


def _handing_on(job: Job) -> Callable[[object], None]:
    """What takes `job`'s items: what its request is told (the turn's items, its reply's text and the tokens'
    log-probabilities); the rest (an eviction, a read's progress, the cache's occupancy) is the chat's to show, not
    a client's."""

    def hand_on(item: object) -> None:
        if isinstance(item, Started | TextDelta | TokenLogprob | Finished):
            _deliver(job, item)

    return hand_on


def _deliver(job: Job, item: object) -> None:
    with suppress(RuntimeError):  # the request's event loop is gone (the server stopped): nobody to tell
        job.deliver(item)


# ---- a request's side: its turn submitted, its items read on its event loop -----------------------


def cache_header(stats: CacheStats) -> str:
    """What a conversation's cache holds: "used/capacity, evicted N"."""
    return f"{stats.used}/{stats.capacity}, evicted {stats.evicted}"


def server_sent_event(payload: dict[str, Any], name: str | None = None) -> str:
    """One server-sent event: `data: {json}`, after `event: NAME` where the API names its events."""
    named = f"event: {name}\n" if name is not None else ""
    return f"{named}data: {json.dumps(payload, ensure_ascii=False)}\n\n"


@dataclass
class RunningTurn:
    """A turn under way: how it began, and its items still to come."""

    turn: Turn
    started: Started
    queue: asyncio.Queue[object]

    @property
    def headers(self) -> dict[str, str]:
        """The reply's headers: the conversation it continues, its cache, what the client should know."""
        return reply_headers(self.started)

    async def finished(self) -> tuple[Finished, list[TokenLogprob]]:
        """The reply's end and its tokens' log-probabilities (where the request asked for them), once it ended."""
        said: list[TokenLogprob] = []
        while True:
            item = await self.queue.get()
            if isinstance(item, ApiError):
                raise item
            if item is END:
                raise ApiError(500, "the reply ended without finishing", kind="server_error")
            if isinstance(item, TokenLogprob):
                said.append(item)
            elif isinstance(item, Finished):
                return item, said

    async def items(self) -> AsyncGenerator[TextDelta | TokenLogprob | Finished, None]:
        """The reply as it comes: its text, its tokens' log-probabilities, then Finished (none when the server
        stopped it before it ended); ApiError when it failed. Its consumer asks for the next item once it sent a
        TextDelta on: closed (aclosing) before Finished, the turn stops, the client told what it was sent."""
        told: list[str] = []  # the reply's text sent: each piece once its consumer came back for more
        finished = False
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, ApiError):
                    raise item
                if item is END:
                    return
                if isinstance(item, Finished):
                    finished = True
                    yield item
                    return
                if isinstance(item, TextDelta | TokenLogprob):
                    yield item
                    if isinstance(item, TextDelta):
                        told.append(item.text)
        finally:
            # A client gone mid-reply: the reply ends within a step, what it said is journaled as stopped, and the
            # conversation is filed under what the client was sent.
            if not finished:
                self.turn.stop(told="".join(told))


@asynccontextmanager
async def running_turn(
    worker: Worker, pool: ConversationPool, request: Request, chat: ChatRequest
) -> AsyncIterator[RunningTurn]:
    """Submit `chat`'s turn and wait for it to begin: 429 when too many wait, 503 when the server stops, the turn's
    own ApiError (404, 409, 400) when it cannot. Until the block ends, a client that goes away stops the turn."""
    turn = Turn(pool, chat, _header_text(request.headers.get(NAMING_HEADER)))
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    if not worker.submit(Job(turn, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))):
        if worker.closing:
            raise ApiError(503, "the server is stopping", kind="server_error", code="stopping")
        raise ApiError(429, "too many requests are waiting; try again shortly", kind="rate_limit_error", code="busy")
    # Until a stream takes over (it watches for itself), a client that goes away stops the turn.
    watcher = asyncio.create_task(_stop_when_gone(request, turn))
    try:
        first = await queue.get()
        if isinstance(first, ApiError):
            raise first
        if not isinstance(first, Started):
            if worker.closing:
                raise ApiError(503, "the server stopped before the reply began", kind="server_error")
            raise ApiError(500, "the reply ended before it started", kind="server_error")
        yield RunningTurn(turn, first, queue)
    finally:
        watcher.cancel()


def reply_headers(started: Started, finished: Finished | None = None) -> dict[str, str]:
    """The headers of a reply that began as `started`; with `finished`, the cache as the reply left it."""
    cache = started.cache if finished is None else finished.cache
    headers = {NAMING_HEADER: started.conversation, CACHE_HEADER: cache_header(cache)}
    if started.warnings:
        # Headers are Latin-1: the warnings are streamchat's own words, in ASCII.
        headers[WARNING_HEADER] = "; ".join(started.warnings)
    return headers


async def _stop_when_gone(request: Request, turn: Turn) -> None:
    """Stop `turn` when the client goes away (once the body is read, receive() only says that); the client
    was sent none of the reply."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    turn.stop(told="")


def _header_text(value: str | None) -> str | None:
    """A header's text as the client wrote it: HTTP carries bytes, which Starlette reads as Latin-1."""
    return None if value is None else value.encode("latin-1").decode("utf-8", "replace")
