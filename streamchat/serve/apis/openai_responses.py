"""OpenAI's Responses API (POST /v1/responses): a request read and checked, responses as OpenAI writes them.

    asked = responses_request(parse_body(body), limits)       # ApiError (400) names the field that is wrong
    earlier = conversation_until(sessions, asked.previous)     # with previous_response_id (response_ids)
    chat = asked.chat_request(earlier)                         # the Turn's request
    response(response_id, created_at, model, asked, finished)  # the whole response
    stream(running, response_id, created_at, model, asked)     # its server-sent events, as the openai SDK reads them

Read: `input` (a string, or message items: user, assistant, and system or developer
before them, each content a string or input_text / output_text parts), `instructions`,
`max_output_tokens`, `temperature`, `top_p`, `stream` and `previous_response_id`; `store`,
`metadata` and `user` are accepted and unused (every conversation is journaled anyway).
`text.format` holds the reply to a JSON schema (`json_schema`, or `json_object`), as the chat
API's response_format does. Tools, `reasoning` or any other field get a 400 that names it.

Stateless as the chat API is: a client sends the whole conversation, or names the response
it goes on from (response_ids says how ids need no state). `instructions` are the system
prompt; left out with `previous_response_id`, the conversation's own go on.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from streamchat.conversation.message import Message, Role
from streamchat.generation.constraint import JsonFormat
from streamchat.generation.events import TextDelta
from streamchat.generation.settings import GenerationChanges
from streamchat.serve.apis.request import (
    ApiError,
    ChatRequest,
    Limits,
    boolean_field,
    checked_text,
    json_format,
    part_text,
    refuse_unknown,
    renamed_settings,
)
from streamchat.serve.replying import RunningTurn, server_sent_event
from streamchat.serve.turn import Finished

ACCEPTED_FIELDS = frozenset(
    {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "previous_response_id"}
)
# Labels a client may attach, accepted and unused; `store` asks OpenAI to keep the response (streamchat journals all).
IGNORED_FIELDS = frozenset({"store", "metadata", "user"})
# What changes nothing, as clients may send it by default. Tool calls are not built yet: tools, and function_call
# items in the input (TOOL_ITEMS), are refused by name; they are the seam where this module reads them into the
# ChatRequest once it carries them (the chat API's, next).
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
}
TOOL_ITEMS = frozenset({"function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output"})
ITEM_KEYS = frozenset({"type", "role", "content", "id", "status"})  # an output item fed back carries an id, a status
PART_TYPES = frozenset({"input_text", "output_text"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
TEXT_FORMAT = {"type": "text"}
# What each kind of text.format may carry: a JSON schema's name, schema, description and strict.
FORMAT_KEYS = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "name", "schema", "description", "strict"}),
}
# The chat API's settings (streamchat.serve.apis.openai_chat) as this API names them.
SETTING_NAMES = {"max_tokens": "max_output_tokens", "temperature": "temperature", "top_p": "top_p"}
# Why a reply ended, where it is not whole: OpenAI's incomplete_details.reason. OpenAI has no word for a reply the
# server cut short: "interrupted", as the chat API's finish_reason.
INCOMPLETE_REASONS = {"max_new_tokens": "max_output_tokens", "interrupted": "interrupted"}
# Echoed in the response object as the request sent them.
ECHOED_FIELDS = ("instructions", "max_output_tokens", "temperature", "top_p", "previous_response_id", "user")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request, checked: the input as messages, how to answer, the response it goes on from."""

    model: str | None
    system: str | None  # instructions, then the input's system and developer messages; None: not given
    turns: list[Message]  # the input's user and assistant messages, alternating from the user's, the user's last
    previous: str | None  # previous_response_id
    stream: bool = False
    settings: GenerationChanges = field(default_factory=GenerationChanges)
    echoed: dict[str, Any] = field(default_factory=dict)  # ECHOED_FIELDS and metadata, as sent
    json_format: JsonFormat | None = None  # text.format's JSON schema, where it asks for one
    text_format: dict[str, Any] = field(default_factory=lambda: dict(TEXT_FORMAT))  # text.format, as sent

    def chat_request(self, earlier: tuple[str | None, list[Message]] | None = None) -> ChatRequest:
        """The Turn's request: `earlier` (the system prompt and messages through the previous response) before the
        input. The instructions given are the system prompt; none given, the conversation's go on."""
        system = self.system
        history: list[Message] = []
        if earlier is not None:
            history = list(earlier[1])
            system = earlier[0] if system is None else system
        said = [*history, *self.turns]
        return ChatRequest(
            self.model,
            system,
            said[:-1],
            said[-1]["content"],
            self.stream,
            settings=self.settings,
            json_format=self.json_format,
        )


def responses_request(body: object, limits: Limits) -> ResponsesRequest:
    """The request in `body` (parsed JSON); ApiError (400) names the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unknown(body, ACCEPTED_FIELDS | {"text"}, IGNORED_FIELDS, NEUTRAL_VALUES)
    text_format = _text_format(body.get("text"))
    for name in ("model", "instructions", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(400, f"{name!r} must be a string", param=name)
    system_parts, turns = _input(body.get("input"), limits)
    instructions = body.get("instructions")
    if instructions is not None:
        system_parts.insert(0, checked_text(instructions, "instructions", limits))
    system = "\n\n".join(system_parts) if system_parts else None
    echoed = {name: body.get(name) for name in ECHOED_FIELDS}
    echoed["metadata"] = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    return ResponsesRequest(
        model=body.get("model"),
        system=system,
        turns=turns,
        previous=body.get("previous_response_id"),
        stream=boolean_field(body, "stream"),
        settings=renamed_settings(body, SETTING_NAMES),
        echoed=echoed,
        json_format=_json_format(text_format),
        text_format=text_format,
    )


def _text_format(value: object) -> dict[str, Any]:
    """`text.format` as sent (plain text where it says none); a verbosity is not implemented."""
    if value is None:
        return dict(TEXT_FORMAT)
    if not isinstance(value, dict):
        raise ApiError(400, "'text' must be an object", param="text")
    extra = sorted(set(value) - {"format"})
    if extra:
        raise ApiError(400, f"'text.{extra[0]}' is not supported by streamchat", param=f"text.{extra[0]}")
    text_format = value.get("format")
    if text_format is None:
        return dict(TEXT_FORMAT)
    if not isinstance(text_format, dict) or text_format.get("type") not in FORMAT_KEYS:
        raise ApiError(
            400,
            '\'text.format\' must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "name": ..., "schema": {...}}',
            param="text.format",
        )
    extra = sorted(set(text_format) - FORMAT_KEYS[text_format["type"]])
    if extra:
        raise ApiError(400, f"'text.format.{extra[0]}' is not supported by streamchat", param=f"text.format.{extra[0]}")
    return text_format


def _json_format(text_format: dict[str, Any]) -> JsonFormat | None:
    """The JSON schema `text.format` holds the reply to; None for text."""
    if text_format["type"] == "text":
        return None
    if text_format["type"] == "json_object":
        return JsonFormat()
    strict = text_format.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, "'text.format.strict' must be true or false", param="text.format.strict")
    return json_format(text_format.get("name", ""), text_format.get("schema"), "text.format")


def _input(value: object, limits: Limits) -> tuple[list[str], list[Message]]:
    """The input's system and developer messages' text, and its user and assistant messages."""
    if isinstance(value, str):
        return [], [{"role": "user", "content": checked_text(value, "input", limits)}]
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of messages", param="input")
    if len(value) > limits.messages:
        raise ApiError(400, f"at most {limits.messages} input items per request", param="input")
    system_parts: list[str] = []
    turns: list[Message] = []
    for index, item in enumerate(value):
        where = f"input[{index}]"
        role = _item_role(item, where)
        content = _content(item.get("content"), f"{where}.content", limits)
        if role in ("system", "developer"):
            if turns:
                raise ApiError(
                    400,
                    f"{where}.role is {role!r}: system and developer messages come before the conversation's",
                    param=f"{where}.role",
                )
            system_parts.append(content)
            continue
        expected: Role = "user" if len(turns) % 2 == 0 else "assistant"
        if role != expected:
            raise ApiError(
                400,
                f"{where}.role is {role!r}, expected {expected!r}: user and assistant messages alternate, "
                "starting with the user",
                param=f"{where}.role",
            )
        turns.append({"role": expected, "content": content})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last input message must be the user's", param="input")
    return system_parts, turns


def _item_role(item: object, where: str) -> str:
    """The role of the message item `item`; ApiError for an item that is no message, or carries what streamchat
    does not read."""
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be a message: an object with a role and content", param=where)
    kind = item.get("type", "message")
    if kind in TOOL_ITEMS:
        raise ApiError(
            400, f"{where}.type is {kind!r}: tool calls are not supported by streamchat", param=f"{where}.type"
        )
    if kind != "message":
        raise ApiError(400, f"{where}.type is {kind!r}: streamchat reads only message items", param=f"{where}.type")
    extra = sorted(set(item) - ITEM_KEYS)
    if extra:
        raise ApiError(400, f"{where}.{extra[0]} is not supported by streamchat", param=f"{where}.{extra[0]}")
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(
            400, f"{where}.role must be user, assistant, system or developer, not {role!r}", param=f"{where}.role"
        )
    return str(role)


def _content(value: object, where: str, limits: Limits) -> str:
    """A message's text: a string, or text parts (joined, as the chat API's)."""
    if isinstance(value, list):
        texts = []
        for index, part in enumerate(value):
            at = f"{where}[{index}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in PART_TYPES:
                said = f"an {kind!r} part" if isinstance(kind, str) else "that"
                raise ApiError(
                    400, f"{at}: streamchat reads only input_text and output_text parts, not {said}", param=at
                )
            texts.append(part_text(part, at, PART_KEYS))
        value = "".join(texts)
    return checked_text(value, where, limits)


# ---- what the server answers ---------------------------------------------------------------------


def response(
    response_id: str, created_at: int, model: str, asked: ResponsesRequest, finished: Finished | None, message_id: str
) -> dict[str, Any]:
    """The response object: in progress (no `finished` yet, no output), completed, or incomplete and why."""
    reason = None if finished is None else INCOMPLETE_REASONS.get(finished.stop_reason)
    status = "in_progress" if finished is None else "incomplete" if reason else "completed"
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": reason} if reason else None,
        "model": model,
        "output": [] if finished is None else [output_message(message_id, finished)],
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": asked.text_format},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "auto",  # what the cache does: the middle of a long conversation leaves it
        "usage": None if finished is None else usage(finished),
        **asked.echoed,
    }


def output_message(message_id: str, finished: Finished) -> dict[str, Any]:
    status = "incomplete" if finished.stop_reason in INCOMPLETE_REASONS else "completed"
    part = {"type": "output_text", "text": finished.reply, "annotations": [], "logprobs": []}
    return {"id": message_id, "type": "message", "status": status, "role": "assistant", "content": [part]}


def usage(finished: Finished) -> dict[str, Any]:
    return {
        "input_tokens": finished.prompt_tokens,
        "input_tokens_details": {"cached_tokens": finished.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": finished.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": finished.prompt_tokens + finished.completion_tokens,
    }


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


async def stream(
    running: RunningTurn, response_id: str, created_at: int, model: str, asked: ResponsesRequest
) -> AsyncIterator[str]:
    """The response as OpenAI streams it: created, in progress, the message and its text part added, the text's
    deltas, then each done, and completed (or incomplete); a failure is an `error` event."""
    numbers = itertools.count()
    message_id = new_message_id()

    def event(payload: dict[str, Any]) -> str:
        return server_sent_event({**payload, "sequence_number": next(numbers)}, payload["type"])

    at = {"item_id": message_id, "output_index": 0, "content_index": 0}
    begun = response(response_id, created_at, model, asked, None, message_id)
    yield event({"type": "response.created", "response": begun})
    yield event({"type": "response.in_progress", "response": begun})
    item = {"id": message_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    yield event({"type": "response.output_item.added", "output_index": 0, "item": item})
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    yield event({"type": "response.content_part.added", **at, "part": part})
    try:
        async with aclosing(running.items()) as items:
            async for said in items:
                if isinstance(said, TextDelta):
                    yield event({"type": "response.output_text.delta", **at, "delta": said.text, "logprobs": []})
                elif isinstance(said, Finished):
                    done = response(response_id, created_at, model, asked, said, message_id)
                    message = done["output"][0]
                    yield event({"type": "response.output_text.done", **at, "text": said.reply, "logprobs": []})
                    yield event({"type": "response.content_part.done", **at, "part": message["content"][0]})
                    yield event({"type": "response.output_item.done", "output_index": 0, "item": message})
                    ended = "response.completed" if done["status"] == "completed" else "response.incomplete"
                    yield event({"type": ended, "response": done})
    except ApiError as error:
        yield event({"type": "error", "code": error.code or error.kind, "message": error.message, "param": error.param})
