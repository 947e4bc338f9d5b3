"""Anthropic's Messages API (POST /v1/messages): a request read into a ChatRequest, replies as Anthropic writes them.

    chat = messages_request(parse_body(body), limits)   # ApiError (400) names the field that is wrong
    message(message_id, model, finished)                 # the whole reply
    stream(running, message_id, model)                   # server-sent events, each with its `event:` line
    error_body(error)                                    # {"type": "error", "error": {"type", "message"}}

Read: `model`, `max_tokens` (required, as Anthropic's), `system` (a string or text blocks),
`messages` (user and assistant alternating, from the user's, each a string or text blocks),
`stop_sequences`, `temperature`, `top_p`, `top_k`, `stream`; `metadata` is accepted and
unused. `tools` and `tool_choice`, tool_use blocks in a reply and tool_result blocks in the
user message after it are read by streamchat.serve.apis.anthropic_tools; a reply's calls are its
tool_use blocks, `stop_reason: "tool_use"`. That user message may hold text blocks after its
tool_result blocks (an agent's reminder): one prompt turn, the results then the user's words,
which the model answers once. Anything else (images, thinking, ...) is refused
with a 400 that names it.

Anthropic counts input apart from the cache: `input_tokens` are those read for this request,
`cache_read_input_tokens` those the conversation's cache already held (the chat API's
`prompt_tokens - cached_tokens` and `cached_tokens`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from streamchat.conversation.message import Message, Role, ToolCall, ToolResult
from streamchat.generation.events import TextDelta
from streamchat.serve.apis.anthropic_tools import (
    results_turn,
    tool_choice_field,
    tool_result_block,
    tool_use_block,
    tool_use_blocks,
    tool_use_events,
    tools_field,
)
from streamchat.serve.apis.openai_tools import HeldText
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
from streamchat.serve.turn import Finished
from streamchat.serve.worker import RunningTurn, server_sent_event

ACCEPTED_FIELDS = frozenset(
    {
        "model",
        "max_tokens",
        "system",
        "messages",
        "stop_sequences",
        "temperature",
        "top_p",
        "top_k",
        "stream",
        "tools",
        "tool_choice",
    }
)
# Accepted and unused: `metadata` says who asks; `cache_control` asks Anthropic to cache the prompt, which a
# streamchat conversation's cache holds anyway.
IGNORED_FIELDS = frozenset({"metadata", "cache_control"})
# What changes nothing, as clients may send it by default.
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {"thinking": ({"type": "disabled"},)}
TOOL_BLOCKS = frozenset({"tool_use", "tool_result"})
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
    tools = tools_field(body.get("tools"))
    tool_choice, parallel = tool_choice_field(body.get("tool_choice"), tools)
    system = _system(body.get("system"), limits)
    history, prompt = _messages(body.get("messages"), limits)
    settings = renamed_settings(body, SETTING_NAMES)
    return ChatRequest(
        model,
        system,
        history,
        prompt,
        boolean_field(body, "stream"),
        settings=settings,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
    )


def _system(value: object, limits: Limits) -> str | None:
    """The system prompt: a string, or text blocks, each an instruction of its own (joined by a blank line, as the
    chat API joins its system messages)."""
    if value is None:
        return None
    if isinstance(value, list):
        return checked_text("\n\n".join(_text_blocks(value, "system")), "system", limits)
    return checked_text(value, "system", limits)


def _messages(value: object, limits: Limits) -> tuple[list[Message], Message]:
    """The history before the new input, and that input: the user's message, or the tool results it holds (and the
    text after them)."""
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
        calls = turns[-1].get("tool_calls", []) if turns else []
        turns.append(_message(expected, message.get("content"), f"{where}.content", calls, limits))
    if turns[-1]["role"] == "assistant":
        raise ApiError(
            400, "'messages' must end with the user's: streamchat does not go on with a reply begun", param="messages"
        )
    return turns[:-1], turns[-1]


def _message(role: Role, content: object, where: str, calls: list[ToolCall], limits: Limits) -> Message:
    """One message: its text (a string, or text blocks joined, as the chat API's parts); a reply's tool_use blocks
    its calls; a user message after calls, their results (tool_result blocks, then any text blocks: the user's
    words after the results, in the same turn)."""
    blocks = content if isinstance(content, list) else None
    if blocks is None or not any(isinstance(b, dict) and b.get("type") in TOOL_BLOCKS for b in blocks):
        if calls:
            raise ApiError(400, f"{where}: the tool_use blocks before it need their tool_result blocks", param=where)
        text = "".join(_text_blocks(blocks, where)) if blocks is not None else content
        return {"role": role, "content": checked_text(text, where, limits)}
    texts: list[str] = []
    made: list[ToolCall] = []
    results: list[ToolResult] = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if role == "assistant" and kind == "tool_use":
            made.append(tool_use_block(block, at, limits))
        elif role == "user" and kind == "tool_result":
            if texts:  # as Anthropic's API: the results answer the reply first, the user's words follow them
                raise ApiError(400, f"{at}: tool_result blocks come first in a message, before its text", param=at)
            results.append(tool_result_block(block, at, calls, results, limits))
        else:
            texts += _text_blocks([block], at, numbered=False)
    text = checked_text("".join(texts), where, limits)
    if role == "user":  # the results, then the user's words after them (agents send a reminder so): one turn
        return results_turn(results, calls, where, text)
    return {"role": role, "content": text, "tool_calls": made}


def _text_blocks(blocks: list[Any], where: str, numbered: bool = True) -> list[str]:
    """The text of each block in `blocks`; only text blocks are read (numbered: `where` names the list, not the
    block)."""
    texts = []
    for index, block in enumerate(blocks):
        at = f"{where}[{index}]" if numbered else where
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in TOOL_BLOCKS:
            raise ApiError(400, f"{at}.type is {kind!r}, which this message may not hold", param=f"{at}.type")
        if kind != "text":
            said = f"a {kind!r} block" if isinstance(kind, str) else "that"
            raise ApiError(400, f"{at}: streamchat reads only text and tool blocks, not {said}", param=at)
        texts.append(part_text(block, at, TEXT_BLOCK_KEYS))
    return texts


# ---- what the server answers ---------------------------------------------------------------------


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def stop_reason(finished: Finished) -> str:
    """Why the reply ended; "tool_use" for one that ended on its calls."""
    if finished.tool_calls and finished.stop_reason in ("eos", "stop_string"):
        return "tool_use"
    return STOP_REASONS.get(finished.stop_reason, finished.stop_reason)


def content(finished: Finished) -> list[dict[str, Any]]:
    """The reply's content blocks: its text (with calls, the text outside them, where there is any), its calls."""
    if not finished.tool_calls or finished.content is None:
        return [{"type": "text", "text": finished.reply}]
    text = [{"type": "text", "text": finished.content}] if finished.content else []
    return [*text, *tool_use_blocks(list(finished.tool_calls))]


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
        "content": content(finished),
        "stop_reason": stop_reason(finished),
        "stop_sequence": finished.stop_string,
        "usage": usage(finished),
    }


async def stream(running: RunningTurn, message_id: str, model: str) -> AsyncIterator[str]:
    """The reply as Anthropic streams it: message_start, a text block's start, deltas and stop, each call's tool_use
    block, message_delta (why it ended, the usage: the input is counted only once read), message_stop; a failure is
    an `error` event. Where calls may be read from the reply, text that may begin one is held back (HeldText), and
    the text block starts with the first text sent (or at the end, for a reply of no calls)."""
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
    held = HeldText(running.started.tool_family)
    opened = held.family is None  # the text block: started at once where the reply is all text
    text_start = {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    if opened:
        yield _event(text_start)
    yield _event({"type": "ping"})
    try:
        async with aclosing(running.items()) as items:
            async for item in items:
                if isinstance(item, TextDelta) and (text := held.add(item.text)):
                    if not opened:
                        opened = True
                        yield _event(text_start)
                    delta = {"type": "text_delta", "text": text}
                    yield _event({"type": "content_block_delta", "index": 0, "delta": delta})
                elif isinstance(item, Finished):
                    rest = held.rest(item.content)
                    if not opened and (rest or not item.tool_calls):
                        opened = True
                        yield _event(text_start)
                    if rest:
                        delta = {"type": "text_delta", "text": rest}
                        yield _event({"type": "content_block_delta", "index": 0, "delta": delta})
                    if opened:
                        yield _event({"type": "content_block_stop", "index": 0})
                    for event in tool_use_events(list(item.tool_calls), 1 if opened else 0):
                        yield _event(event)
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
