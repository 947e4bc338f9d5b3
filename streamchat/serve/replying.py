"""A request's turn, run for a route whatever API it speaks: handed to the worker, watched, its items read.

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
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from streamchat.cache.ledger import CacheStats
from streamchat.generation.events import TextDelta, TokenLogprob
from streamchat.serve.apis.request import ApiError, ChatRequest
from streamchat.serve.pool import NAMING_HEADER, ConversationPool
from streamchat.serve.turn import Finished, Started, Turn
from streamchat.serve.worker import END, Job, Worker

CACHE_HEADER = "X-Streamchat-Cache"
WARNING_HEADER = "X-Streamchat-Warning"


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
