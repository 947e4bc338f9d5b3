"""The HTTP face: Starlette routes over the worker, in the OpenAI chat API's shapes.

    POST /v1/chat/completions   a reply, whole or streamed as server-sent events
    GET  /v1/models             the one model served
    GET  /v1/conversations      the conversations: live, parked, saved
    GET  /health                no key needed

Every reply says which conversation it continued and what its cache holds, in the
X-Streamchat-Conversation and X-Streamchat-Cache headers, and X-Streamchat-Warning says
what the client should know of it (a max_tokens clamped, a message read only in part).
With an API key, every endpoint but /health wants `Authorization: Bearer KEY`. Errors are
OpenAI's error body. A client that goes away stops its reply within a step, streamed or
not; a body not sent within SERVE_BODY_SECONDS is a 408.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from streamchat import defaults
from streamchat.cache.ledger import CacheStats
from streamchat.generation.events import TextDelta, TokenLogprob
from streamchat.serve import openai_api as api
from streamchat.serve.openai_api import ApiError, Limits
from streamchat.serve.pool import NAMING_HEADER, ConversationPool
from streamchat.serve.turn import Finished, Started, Turn
from streamchat.serve.worker import END, Job, Worker
from streamchat.storage.session_file import list_sessions

CACHE_HEADER = "X-Streamchat-Cache"
WARNING_HEADER = "X-Streamchat-Warning"

log = logging.getLogger("streamchat.serve")


@dataclass(frozen=True)
class HttpOptions:
    api_key: str | None = None
    cors: tuple[str, ...] = ()  # origins a browser page may call from; none: CORS off
    limits: Limits = field(default_factory=Limits)
    retry_after: int = defaults.SERVE_RETRY_AFTER_SECONDS
    body_seconds: float = defaults.SERVE_BODY_SECONDS  # to send the whole body, once the headers are in


def cache_header(stats: CacheStats) -> str:
    """What a conversation's cache holds: "used/capacity, evicted N"."""
    return f"{stats.used}/{stats.capacity}, evicted {stats.evicted}"


def create_app(worker: Worker, pool: ConversationPool, options: HttpOptions) -> Starlette:
    model = pool.served.name
    started_at = int(time.time())

    def check_key(request: Request) -> None:
        if options.api_key is None:
            return
        given = request.headers.get("authorization", "").encode("utf-8")
        if not hmac.compare_digest(given, f"Bearer {options.api_key}".encode()):
            raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY", code="invalid_api_key")

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model})

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse(api.model_list(model, started_at))

    async def conversations(request: Request) -> Response:
        check_key(request)
        listed = []
        for conversation_id, conversation in list(pool.conversations.items()):
            state = "busy" if conversation.busy else "live" if conversation.session is not None else "parked"
            listed.append({"id": conversation_id, "object": "conversation", "state": state})
        held = {entry["id"] for entry in listed}
        summaries, _ = await run_in_threadpool(list_sessions, pool.served.sessions)
        for summary in summaries:
            if summary.path.suffix == ".jsonl" and summary.path.stem not in held:
                state = "parked" if pool.is_parked(summary.path.stem) else "saved"
                listed.append({"id": summary.path.stem, "object": "conversation", "state": state})
        return JSONResponse({"object": "list", "data": listed})

    async def chat_completions(request: Request) -> Response:
        check_key(request)
        body = await _body(request, options.limits.body_bytes, options.body_seconds)
        chat = api.chat_request(api.parse_body(body), options.limits)
        turn = Turn(pool, chat, _header_text(request.headers.get(NAMING_HEADER)))
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[object] = asyncio.Queue()
        if not worker.submit(Job(turn, lambda item: loop.call_soon_threadsafe(queue.put_nowait, item))):
            if worker.closing:
                raise ApiError(503, "the server is stopping", kind="server_error", code="stopping")
            raise ApiError(
                429, "too many requests are waiting; try again shortly", kind="rate_limit_error", code="busy"
            )
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
            reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            headers = _reply_headers(first)
            if chat.stream:
                watcher.cancel()
                events = _stream(queue, turn, reply_id, created, model, chat.include_usage, chat.logprobs is not None)
                return StreamingResponse(events, media_type="text/event-stream", headers=headers)
            return await _whole(queue, headers, reply_id, created, model, chat.logprobs is not None)
        finally:
            watcher.cancel()

    async def api_error(request: Request, error: Exception) -> Response:
        if not isinstance(error, ApiError):
            raise error
        headers = {"Retry-After": str(options.retry_after)} if error.status == 429 else None
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    async def http_error(request: Request, error: Exception) -> Response:
        status = error.status_code if isinstance(error, HTTPException) else 500
        return JSONResponse(ApiError(status, str(getattr(error, "detail", error))).body(), status_code=status)

    middleware = []
    if options.cors:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(options.cors),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type", NAMING_HEADER],
                expose_headers=[NAMING_HEADER, CACHE_HEADER],
            )
        )
    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/conversations", conversations),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ]

    async def server_error(request: Request, error: Exception) -> Response:
        # A bug: logged with its traceback by Starlette, answered in OpenAI's shape so clients can say what it was.
        return JSONResponse(ApiError(500, f"the server failed: {error!r}", kind="server_error").body(), status_code=500)

    handlers = {ApiError: api_error, HTTPException: http_error, Exception: server_error}
    return Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)


async def _body(request: Request, limit: int, seconds: float) -> bytes:
    """The request body: 413 past `limit` bytes before more is read, 408 when it takes past `seconds`."""
    too_large = ApiError(413, f"the request body is larger than {limit:,} bytes", code="request_too_large")
    length = request.headers.get("content-length", "")
    if length and "transfer-encoding" in request.headers:
        # Two framings that disagree: which one ends the body is the ground of request smuggling.
        raise ApiError(400, "a request may not carry both Content-Length and Transfer-Encoding")
    if length.isdigit() and int(length) > limit:
        raise too_large
    pieces, size = [], 0

    async def read() -> None:
        nonlocal size
        async for piece in request.stream():
            size += len(piece)
            if size > limit:
                raise too_large
            pieces.append(piece)

    try:
        await asyncio.wait_for(read(), seconds)
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body was not sent within {seconds:g} s", code="request_timeout") from None
    except ClientDisconnect:
        log.warning("a request's body was cut short: its client went away, or broke its framing")
        raise ApiError(400, "the request's body was cut short") from None
    return b"".join(pieces)


async def _stop_when_gone(request: Request, turn: Turn) -> None:
    """Stop `turn` when the client goes away (once the body is read, receive() only says that); the client
    was sent none of the reply."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    turn.stop(told="")


def _header_text(value: str | None) -> str | None:
    """A header's text as the client wrote it: HTTP carries bytes, which Starlette reads as Latin-1."""
    return None if value is None else value.encode("latin-1").decode("utf-8", "replace")


def _reply_headers(started: Started) -> dict[str, str]:
    headers = {NAMING_HEADER: started.conversation, CACHE_HEADER: cache_header(started.cache)}
    if started.warnings:
        # Headers are Latin-1: the warnings are streamchat's own words, in ASCII.
        headers[WARNING_HEADER] = "; ".join(started.warnings)
    return headers


async def _whole(
    queue: asyncio.Queue[object], headers: dict[str, str], reply_id: str, created: int, model: str, logprobs: bool
) -> Response:
    said: list[TokenLogprob] = []
    while True:
        item = await queue.get()
        if isinstance(item, ApiError):
            raise item
        if item is END:
            raise ApiError(500, "the reply ended without finishing", kind="server_error")
        if isinstance(item, TokenLogprob):
            said.append(item)
        if isinstance(item, Finished):
            used = api.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
            finish = api.finish_reason(item.stop_reason)
            body = api.completion(reply_id, created, model, item.reply, finish, used, said if logprobs else None)
            return JSONResponse(body, headers={**headers, CACHE_HEADER: cache_header(item.cache)})


async def _stream(
    queue: asyncio.Queue[object],
    turn: Turn,
    reply_id: str,
    created: int,
    model: str,
    include_usage: bool,
    logprobs: bool,
) -> AsyncIterator[str]:
    told: list[str] = []  # the reply's text sent: each piece once the client's connection took it
    # Tokens' log-probabilities not sent yet: each goes with the next text (a token's text may be held back, at a
    # stop string or a split character), the last with the reply's end.
    unsent: list[TokenLogprob] = []
    finished = False

    def taken() -> list[TokenLogprob] | None:
        sent = unsent.copy()
        unsent.clear()
        return sent if logprobs else None

    try:
        yield _event(api.chunk(reply_id, created, model, {"role": "assistant", "content": ""}))
        while True:
            item = await queue.get()
            if isinstance(item, TokenLogprob):
                unsent.append(item)
            elif isinstance(item, TextDelta):
                yield _event(api.chunk(reply_id, created, model, {"content": item.text}, logprobs=taken()))
                told.append(item.text)
            elif isinstance(item, Finished):
                finished = True
                finish = api.finish_reason(item.stop_reason)
                yield _event(api.chunk(reply_id, created, model, {}, finish, logprobs=taken()))
                if include_usage:
                    used = api.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                    yield _event(api.usage_chunk(reply_id, created, model, used))
                yield "data: [DONE]\n\n"
                return
            elif isinstance(item, ApiError):
                yield _event(item.body())
                return
            elif item is END:
                return
    finally:
        # A client gone mid-reply: the reply ends within a step, what it said is journaled as stopped, and the
        # conversation is filed under what the client was sent.
        if not finished:
            turn.stop(told="".join(told))


def _event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
