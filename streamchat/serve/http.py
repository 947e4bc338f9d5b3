"""The HTTP face: Starlette routes over the worker, in OpenAI's and Anthropic's API shapes.

    POST /v1/chat/completions   OpenAI's chat completions: a reply, whole or streamed as server-sent events
    POST /v1/responses          OpenAI's Responses API (streamchat.serve.apis.openai_responses)
    POST /v1/messages           Anthropic's Messages API (streamchat.serve.apis.anthropic_messages)
    GET  /v1/models             the one model served
    GET  /v1/conversations      the conversations: live, parked, saved
    GET  /health                no key needed

Every API reads its request into a ChatRequest and runs the same Turn on the same
conversations (streamchat.serve.worker: running_turn); each only formats. Every reply says which
conversation it continued and what its cache holds, in the X-Streamchat-Conversation and
X-Streamchat-Cache headers, and X-Streamchat-Warning says what the client should know of it
(a max_tokens clamped, a message read only in part). With an API key, every endpoint but
/health wants `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's clients send that).
Errors are OpenAI's error body, Anthropic's on /v1/messages. A client that goes away stops its
reply within a step, streamed or not; a body not sent within SERVE_BODY_SECONDS is a 408.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from streamchat import defaults
from streamchat.generation.events import TextDelta, TokenLogprob
from streamchat.serve.apis import anthropic_messages as messages_api
from streamchat.serve.apis import openai_chat as api
from streamchat.serve.apis import openai_responses as responses_api
from streamchat.serve.apis.openai_tools import HeldText, call_deltas
from streamchat.serve.apis.request import ApiError, Limits, parse_body
from streamchat.serve.apis.response_ids import conversation_until, response_id
from streamchat.serve.pool import NAMING_HEADER, ConversationPool
from streamchat.serve.turn import Finished
from streamchat.serve.worker import (
    CACHE_HEADER,
    RunningTurn,
    Worker,
    reply_headers,
    running_turn,
    server_sent_event,
)
from streamchat.storage.session_file import list_sessions

log = logging.getLogger("streamchat.serve")


@dataclass(frozen=True)
class HttpOptions:
    api_key: str | None = None
    cors: tuple[str, ...] = ()  # origins a browser page may call from; none: CORS off
    limits: Limits = field(default_factory=Limits)
    retry_after: int = defaults.SERVE_RETRY_AFTER_SECONDS
    body_seconds: float = defaults.SERVE_BODY_SECONDS  # to send the whole body, once the headers are in


def create_app(worker: Worker, pool: ConversationPool, options: HttpOptions) -> Starlette:
    model = pool.served.name
    started_at = int(time.time())

    def check_key(request: Request) -> None:
        if options.api_key is None:
            return
        bearer = request.headers.get("authorization", "").encode("utf-8")
        given = request.headers.get("x-api-key", "").encode("utf-8")
        # Both compared, always: how long the check takes says nothing of which header came close.
        as_bearer = hmac.compare_digest(bearer, f"Bearer {options.api_key}".encode())
        as_header = hmac.compare_digest(given, options.api_key.encode())
        if not (as_bearer or as_header):
            raise ApiError(
                401, "a valid API key is needed: Authorization: Bearer KEY, or x-api-key: KEY", code="invalid_api_key"
            )

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": model})

    async def models(request: Request) -> Response:
        check_key(request)
        return JSONResponse(api.model_list(model, started_at, pool.served.meta))

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
        chat = api.chat_request(parse_body(body), options.limits)
        logprobs = chat.logprobs is not None
        async with running_turn(worker, pool, request, chat) as running:
            reply_id, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
            if chat.stream:
                events = _chat_stream(running, reply_id, created, model, chat.include_usage, logprobs)
                return StreamingResponse(events, media_type="text/event-stream", headers=running.headers)
            finished, said = await running.finished()
        used = api.usage(finished.prompt_tokens, finished.completion_tokens, finished.cached_tokens)
        finish = api.finish_reason(finished.stop_reason, bool(finished.tool_calls))
        text = finished.reply if finished.content is None else finished.content
        said_logprobs = said if logprobs else None
        reply = api.completion(reply_id, created, model, text, finish, used, said_logprobs, list(finished.tool_calls))
        return JSONResponse(reply, headers=reply_headers(running.started, finished))

    async def responses(request: Request) -> Response:
        check_key(request)
        body = await _body(request, options.limits.body_bytes, options.body_seconds)
        asked = responses_api.responses_request(parse_body(body), options.limits)
        earlier = None
        if asked.previous is not None:
            earlier = await run_in_threadpool(conversation_until, pool.served.sessions, asked.previous)
        async with running_turn(worker, pool, request, asked.chat_request(earlier)) as running:
            started = running.started
            # Named by where it leaves its conversation: the user message and this reply, two more.
            named, created = response_id(started.conversation, started.messages + 2), int(time.time())
            if asked.stream:
                events = responses_api.stream(running, named, created, model, asked)
                return StreamingResponse(events, media_type="text/event-stream", headers=running.headers)
            finished, _ = await running.finished()
        said = responses_api.response(named, created, model, asked, finished, responses_api.new_message_id())
        return JSONResponse(said, headers=reply_headers(started, finished))

    async def messages(request: Request) -> Response:
        try:
            check_key(request)
            body = await _body(request, options.limits.body_bytes, options.body_seconds)
            chat = messages_api.messages_request(parse_body(body), options.limits)
            message_id = messages_api.new_message_id()
            async with running_turn(worker, pool, request, chat) as running:
                if chat.stream:
                    events = messages_api.stream(running, message_id, model)
                    return StreamingResponse(events, media_type="text/event-stream", headers=running.headers)
                finished, _ = await running.finished()
            said = messages_api.message(message_id, model, finished)
            return JSONResponse(said, headers=reply_headers(running.started, finished))
        except ApiError as error:  # in Anthropic's shape, which its clients read
            return _error_response(error, messages_api.error_body(error), options.retry_after)

    async def api_error(request: Request, error: Exception) -> Response:
        if not isinstance(error, ApiError):
            raise error
        return _error_response(error, error.body(), options.retry_after)

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
                allow_headers=["Authorization", "Content-Type", NAMING_HEADER, "X-Api-Key", "Anthropic-Version"],
                expose_headers=[NAMING_HEADER, CACHE_HEADER],
            )
        )
    routes = [
        Route("/health", health),
        Route("/v1/models", models),
        Route("/v1/conversations", conversations),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
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


def _error_response(error: ApiError, body: dict[str, object], retry_after: int) -> Response:
    """`error` answered with `body` (its API's shape); a 429 says when to try again."""
    headers = {"Retry-After": str(retry_after)} if error.status == 429 else None
    return JSONResponse(body, status_code=error.status, headers=headers)


async def _chat_stream(
    running: RunningTurn, reply_id: str, created: int, model: str, include_usage: bool, logprobs: bool
) -> AsyncIterator[str]:
    """The chat completion's chunks: the role, the text, why it ended, the usage if asked, then [DONE]; a failure is
    an error chunk."""
    # Tokens' log-probabilities not sent yet: each goes with the next text (a token's text may be held back, at a
    # stop string or a split character), the last with the reply's end.
    unsent: list[TokenLogprob] = []

    def taken() -> list[TokenLogprob] | None:
        sent = unsent.copy()
        unsent.clear()
        return sent if logprobs else None

    yield server_sent_event(api.chunk(reply_id, created, model, {"role": "assistant", "content": ""}))
    held = HeldText(running.started.tool_family)  # text that may begin a tool call waits for the reply's end
    try:
        async with aclosing(running.items()) as items:
            async for item in items:
                if isinstance(item, TokenLogprob):
                    unsent.append(item)
                elif isinstance(item, TextDelta) and (text := held.add(item.text)):
                    yield server_sent_event(api.chunk(reply_id, created, model, {"content": text}, logprobs=taken()))
                elif isinstance(item, Finished):
                    if rest := held.rest(item.content):
                        yield server_sent_event(api.chunk(reply_id, created, model, {"content": rest}))
                    for delta in call_deltas(list(item.tool_calls)):
                        yield server_sent_event(api.chunk(reply_id, created, model, delta))
                    finish = api.finish_reason(item.stop_reason, bool(item.tool_calls))
                    yield server_sent_event(api.chunk(reply_id, created, model, {}, finish, logprobs=taken()))
                    if include_usage:
                        used = api.usage(item.prompt_tokens, item.completion_tokens, item.cached_tokens)
                        yield server_sent_event(api.usage_chunk(reply_id, created, model, used))
                    yield "data: [DONE]\n\n"
    except ApiError as error:
        yield server_sent_event(error.body())
