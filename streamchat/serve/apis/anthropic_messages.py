"""Anthropic's Messages API (POST /v1/messages): a request read into a ChatRequest, replies as Anthropic writes them.

    chat = messages_request(parse_body(body), limits)   # ApiError (400) names the field that is wrong
    message(message_id, model, finished)                 # the whole reply
    stream(running, message_id, model)                   # server-sent events, each with its `event:` line
    error_body(error)                                    # {"type": "error", "error": {"type", "message"}}

Read: `model`, `max_tokens` (required, as Anthropic's), `system` (a string or text blocks),
`messages` (user and assistant alternating, from the user's, each a string or text blocks),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`; `metadata` is accepted and
unused. Anything else (images, tools, thinking, ...) is refused with a 400 that names it.

Anthropic counts input apart from the cache: `input_tokens` are those read for this request,
`cache_read_input_tokens` those the conversation's cache already held (the chat API's
`prompt_tokens - cached_tokens` and `cached_tokens`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from streamchat.conversation.message import Message, Role
from streamchat.generation.events import TextDelta
from streamchat.serve.apis.request import (
    ApiError,
    ChatRequest,
    Limits,
    boolean_field,
    checked_text,
    part_text,
    refuse_unknown,
    renamed_settings,
)
from streamchat.serve.replying import RunningTurn, server_sent_event
from streamchat.serve.turn import Finished

ACCEPTED_FIELDS = frozenset(
    {"model", "max_tokens", "system", "messages", "stop_sequences", "temperature", "top_p", "top_k", "stream"}
)
# Accepted and unused: `metadata` says who asks; `cache_control` asks Anthropic to cache the prompt, which a
# streamchat conversation's cache holds anyway.
IGNORED_FIELDS = frozenset({"metadata", "cache_control"})
# What changes nothing, as clients may send it by default. Tool use is not built yet: `tools` and `tool_choice` with
# tools in them, and tool_use / tool_result blocks (TOOL_BLOCKS), are refused by name. They are the seam for it: once
# ChatRequest carries tools and tool calls (the chat API's, next), this module reads them into it.
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "tools": ([],),
    "tool_choice": ({"type": "none"}, {"type": "auto"}),
    "thinking": ({"type": "disabled"},),
}
TOOL_BLOCKS = frozenset({"tool_use", "tool_result", "server_tool_use"})
# A text block's keys: cache_control asks Anthropic to cache up to there, which streamchat's conversations do anyway.
TEXT_BLOCK_KEYS = frozenset({"type", "text", "cache_control", "citations"})
# The chat API's settings (streamchat.serve.apis.openai_chat) as this API names them.
SETTING_NAMES = {
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "stop": "stop_sequences",
}
# Why a reply ended (streamchat.generation.events.StopReason), as stop_reason says it. Anthropic has no word for a
# reply the server cut short: "interrupted", as the chat API's finish_reason, and not end_turn, which would say whole.
STOP_REASONS = {"eos": "end_turn", "stop_string": "stop_sequence", "max_new_tokens": "max_tokens"}
# Anthropic's error types, by HTTP status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def messages_request(body: object, limits: Limits) -> ChatRequest:
    """The request in `body` (parsed JSON); ApiError (400) names the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unknown(body, ACCEPTED_FIELDS, IGNORED_FIELDS, NEUTRAL_VALUES)
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required: the most tokens the reply may have", param="max_tokens")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    system = _system(body.get("system"), limits)
    history, text = _messages(body.get("messages"), limits)
    settings = renamed_settings(body, SETTING_NAMES)
    return ChatRequest(model, system, history, text, boolean_field(body, "stream"), settings=settings)


def _system(value: object, limits: Limits) -> str | None:
    """The system prompt: a string, or text blocks, each an instruction of its own (joined by a blank line, as the
    chat API joins its system messages)."""
    if value is None:
        return None
    if isinstance(value, list):
        return checked_text("\n\n".join(_text_blocks(value, "system")), "system", limits)
    return checked_text(value, "system", limits)


def _messages(value: object, limits: Limits) -> tuple[list[Message], str]:
    """The history before the new user message, and that message's text."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if len(value) > limits.messages:
        raise ApiError(400, f"at most {limits.messages} messages per request", param="messages")
    turns: list[Message] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with a role and content", param=where)
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported by streamchat", param=f"{where}.{extra[0]}")
        expected: Role = "user" if index % 2 == 0 else "assistant"
        if message.get("role") != expected:
            raise ApiError(
                400,
                f"{where}.role is {message.get('role')!r}, expected {expected!r}: "
                "user and assistant messages alternate, starting with the user",
                param=f"{where}.role",
            )
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(_text_blocks(content, f"{where}.content"))  # a message's parts, as the chat API's
        turns.append({"role": expected, "content": checked_text(content, f"{where}.content", limits)})
    if turns[-1]["role"] != "user":
        raise ApiError(
            400, "'messages' must end with the user's: streamchat does not go on with a reply begun", param="messages"
        )
    return turns[:-1], turns[-1]["content"]


def _text_blocks(blocks: list[Any], where: str) -> list[str]:
    """The text of each block in `blocks`; only text blocks are read."""
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in TOOL_BLOCKS:
            raise ApiError(400, f"{at}.type is {kind!r}: tool use is not supported by streamchat", param=f"{at}.type")
        if kind != "text":
            said = f"a {kind!r} block" if isinstance(kind, str) else "that"
            raise ApiError(400, f"{at}: streamchat reads only text blocks, not {said}", param=at)
        texts.append(part_text(block, at, TEXT_BLOCK_KEYS))
    return texts


# ---- what the server answers ---------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finished: Finished) -> str:
    return STOP_REASONS.get(finished.stop_reason, finished.stop_reason)


def usage(finished: Finished) -> dict[str, int]:
    return {
        "input_tokens": finished.prompt_tokens - finished.cached_tokens,
        "output_tokens": finished.completion_tokens,
        "cache_read_input_tokens": finished.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def message(message_id: str, model: str, finished: Finished) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": finished.reply}],
        "stop_reason": stop_reason(finished),
        "stop_sequence": finished.stop_string,
        "usage": usage(finished),
    }


async def stream(running: RunningTurn, message_id: str, model: str) -> AsyncIterator[str]:
    """The reply as Anthropic streams it: message_start, one text block's start, deltas and stop, message_delta
    (why it ended, the usage: the input is counted only once read), message_stop; a failure is an `error` event."""
    started: dict[str, Any] = {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    yield _event({"type": "message_start", "message": started})
    yield _event({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event({"type": "ping"})
    try:
        async with aclosing(running.items()) as items:
            async for item in items:
                if isinstance(item, TextDelta):
                    delta = {"type": "text_delta", "text": item.text}
                    yield _event({"type": "content_block_delta", "index": 0, "delta": delta})
                elif isinstance(item, Finished):
                    yield _event({"type": "content_block_stop", "index": 0})
                    ended = {"stop_reason": stop_reason(item), "stop_sequence": item.stop_string}
                    yield _event({"type": "message_delta", "delta": ended, "usage": usage(item)})
                    yield _event({"type": "message_stop"})
    except ApiError as error:
        yield server_sent_event(error_body(error), "error")


def _event(payload: dict[str, Any]) -> str:
    return server_sent_event(payload, payload["type"])


def error_body(error: ApiError) -> dict[str, Any]:
    """Anthropic's error body for `error`: its type by the HTTP status, its message naming the field."""
    kind = ERROR_TYPES.get(error.status, "api_error" if error.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}
