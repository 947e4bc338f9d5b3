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
API's response_format does. `tools`, `tool_choice`, `parallel_tool_calls` and the input's
function_call and function_call_output items are read by streamchat.serve.apis.responses_tools:
consecutive function_call items (after an assistant message or not) are one reply's calls, the
function_call_output items after them its results (with a user message after them, one turn:
the results, then the user's words), and, last, the new input. A reply's calls are
function_call output items, after a message item where it has text outside them. `reasoning` or
any other field gets a 400 that names it.

Stateless as the chat API is: a client sends the whole conversation, or names the response
it goes on from (response_ids says how ids need no state). `instructions` are the system
prompt; left out with `previous_response_id`, the conversation's own go on. Going on from a
response whose reply called functions, the input is their function_call_output items alone.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from streamchat.conversation.message import Message
from streamchat.generation.constraint import JsonFormat
from streamchat.generation.events import TextDelta
from streamchat.generation.settings import GenerationChanges
from streamchat.serve.apis.openai_tools import HeldText
from streamchat.serve.apis.request import (
    TEXT_FORMAT,
    ApiError,
    ChatRequest,
    Limits,
    boolean_field,
    checked_text,
    held_format,
    part_text,
    refuse_unknown,
    renamed_settings,
    text_format_field,
)
from streamchat.serve.apis.responses_tools import (
    InputTurns,
    answered,
    echoed_tools,
    function_call_events,
    function_call_item,
    function_call_items,
    function_call_output_item,
    tool_choice_field,
    tools_field,
)
from streamchat.serve.turn import Finished
from streamchat.serve.worker import RunningTurn, server_sent_event

ACCEPTED_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "previous_response_id",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
    }
)
# Labels a client may attach, accepted and unused; `store` asks OpenAI to keep the response (streamchat journals all).
IGNORED_FIELDS = frozenset({"store", "metadata", "user"})
TOOL_ITEMS = frozenset({"function_call", "function_call_output"})
ITEM_KEYS = frozenset({"type", "role", "content", "id", "status"})  # an output item fed back carries an id, a status
PART_TYPES = frozenset({"input_text", "output_text"})
PART_KEYS = frozenset({"type", "text", "annotations", "logprobs"})
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
    tools: list[dict[str, Any]] | None = None  # the chat API's function specs
    tool_choice: str = "none"
    parallel_tool_calls: bool = True
    # Where the input begins with function_call_output items (going on from a response): where each was sent. They
    # answer the previous response's calls, checked once its conversation is read.
    leading: tuple[str, ...] = ()

    def chat_request(self, earlier: tuple[str | None, list[Message]] | None = None) -> ChatRequest:
        """The Turn's request: `earlier` (the system prompt and messages through the previous response) before the
        input. The instructions given are the system prompt; none given, the conversation's go on."""
        system = self.system
        history: list[Message] = []
        if earlier is not None:
            history = list(earlier[1])
            system = earlier[0] if system is None else system
        calls = history[-1].get("tool_calls", []) if history else []
        if self.leading:
            answered(self.turns[0].get("tool_results", []), list(self.leading), calls, "input")
        elif calls:
            raise ApiError(
                400,
                f"the function_call {calls[0]['id']!r} of {self.previous!r} needs its function_call_output first",
                param="input",
            )
        said = [*history, *self.turns]
        return ChatRequest(
            self.model,
            system,
            said[:-1],
            said[-1],
            self.stream,
            settings=self.settings,
            json_format=self.json_format,
            tools=self.tools,
            tool_choice=self.tool_choice,
            parallel_tool_calls=self.parallel_tool_calls,
        )


def responses_request(body: object, limits: Limits) -> ResponsesRequest:
    """The request in `body` (parsed JSON); ApiError (400) names the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unknown(body, ACCEPTED_FIELDS | {"text"}, IGNORED_FIELDS)
    text_format = text_format_field(body.get("text"))
    for name in ("model", "instructions", "previous_response_id"):
        if body.get(name) is not None and not isinstance(body[name], str):
            raise ApiError(400, f"{name!r} must be a string", param=name)
    tools = tools_field(body.get("tools"))
    tool_choice = tool_choice_field(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls") is None or boolean_field(body, "parallel_tool_calls")
    system_parts, turns, leading = _input(body.get("input"), limits, body.get("previous_response_id") is not None)
    instructions = body.get("instructions")
    if instructions is not None:
        system_parts.insert(0, checked_text(instructions, "instructions", limits))
    system = "\n\n".join(system_parts) if system_parts else None
    echoed = {name: body.get(name) for name in ECHOED_FIELDS}
    echoed["metadata"] = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    echoed.update(echoed_tools(tools, tool_choice, parallel))
    return ResponsesRequest(
        model=body.get("model"),
        system=system,
        turns=turns,
        previous=body.get("previous_response_id"),
        stream=boolean_field(body, "stream"),
        settings=renamed_settings(body, SETTING_NAMES),
        echoed=echoed,
        json_format=held_format(text_format),
        text_format=text_format,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        leading=leading,
    )


def _input(value: object, limits: Limits, going_on: bool) -> tuple[list[str], list[Message], tuple[str, ...]]:
    """The input's system and developer messages' text, its conversation (user messages, replies with their calls,
    tool results: a prompt turn and a reply alternating), and where its leading function_call_output items were
    sent (`going_on` from a response, whose calls they answer)."""
    if isinstance(value, str):
        return [], [{"role": "user", "content": checked_text(value, "input", limits)}], ()
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'input' must be a string or a non-empty list of messages", param="input")
    if len(value) > limits.messages:
        raise ApiError(400, f"at most {limits.messages} input items per request", param="input")
    system_parts: list[str] = []
    turns = InputTurns(going_on)
    for index, item in enumerate(value):
        where = f"input[{index}]"
        kind = _item_kind(item, where)
        if kind == "function_call":
            turns.add_call(function_call_item(item, where, limits), where)
        elif kind == "function_call_output":
            turns.add_result(function_call_output_item(item, where, limits), where)
        elif item["role"] in ("system", "developer"):
            if turns.turns:
                raise ApiError(
                    400,
                    f"{where}.role is {item['role']!r}: system and developer messages come before the conversation's",
                    param=f"{where}.role",
                )
            system_parts.append(_content(item.get("content"), f"{where}.content", limits))
        else:
            turns.add_message(item["role"], _content(item.get("content"), f"{where}.content", limits), where)
    said, leading = turns.checked()
    return system_parts, said, leading


def _item_kind(item: object, where: str) -> str:
    """What the input item `item` is: a message (of a role streamchat reads), a function_call or its output;
    ApiError for any other, or a message that carries what streamchat does not read."""
    if not isinstance(item, dict):
        raise ApiError(400, f"{where} must be a message: an object with a role and content", param=where)
    kind = item.get("type", "message")
    if kind in TOOL_ITEMS:
        return str(kind)
    if kind != "message":
        raise ApiError(
            400, f"{where}.type is {kind!r}: streamchat reads only message and function items", param=f"{where}.type"
        )
    extra = sorted(set(item) - ITEM_KEYS)
    if extra:
        raise ApiError(400, f"{where}.{extra[0]} is not supported by streamchat", param=f"{where}.{extra[0]}")
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(
            400, f"{where}.role must be user, assistant, system or developer, not {role!r}", param=f"{where}.role"
        )
    return "message"


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
        "output": [] if finished is None else output_items(message_id, finished),
        "parallel_tool_calls": False,
        "tool_choice": "none",
        "tools": [],
        "text": {"format": asked.text_format},
        "reasoning": {"effort": None, "summary": None},
        "truncation": "auto",  # what the cache does: the middle of a long conversation leaves it
        "usage": None if finished is None else usage(finished),
        **asked.echoed,
    }


def output_items(message_id: str, finished: Finished) -> list[dict[str, Any]]:
    """A reply's output: its message, and its calls (after the message, where it has text outside them)."""
    if not finished.tool_calls or finished.content is None:
        return [output_message(message_id, finished)]
    text = [output_message(message_id, finished, finished.content)] if finished.content else []
    return [*text, *function_call_items(list(finished.tool_calls))]


def output_message(message_id: str, finished: Finished, text: str | None = None) -> dict[str, Any]:
    """The reply's message item: `text`, or the reply whole."""
    status = "incomplete" if finished.stop_reason in INCOMPLETE_REASONS else "completed"
    said = finished.reply if text is None else text
    part = {"type": "output_text", "text": said, "annotations": [], "logprobs": []}
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
    deltas, each done, each call's item, then completed (or incomplete); a failure is an `error` event. Text that
    may begin a call is held back (HeldText): the message is added with the first text sent."""
    numbers = itertools.count()
    message_id = new_message_id()

    def event(payload: dict[str, Any]) -> str:
        return server_sent_event({**payload, "sequence_number": next(numbers)}, payload["type"])

    at = {"item_id": message_id, "output_index": 0, "content_index": 0}
    begun = response(response_id, created_at, model, asked, None, message_id)
    yield event({"type": "response.created", "response": begun})
    yield event({"type": "response.in_progress", "response": begun})
    item = {"id": message_id, "type": "message", "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    opening = [{"type": "response.output_item.added", "output_index": 0, "item": item}]
    opening.append({"type": "response.content_part.added", **at, "part": part})
    held = HeldText(running.started.tool_family)
    opened = held.family is None  # the message: added at once where the reply is all text
    if opened:
        for payload in opening:
            yield event(payload)
    try:
        async with aclosing(running.items()) as items:
            async for said in items:
                if isinstance(said, TextDelta) and (text := held.add(said.text)):
                    if not opened:
                        opened = True
                        for payload in opening:
                            yield event(payload)
                    yield event({"type": "response.output_text.delta", **at, "delta": text, "logprobs": []})
                elif isinstance(said, Finished):
                    done = response(response_id, created_at, model, asked, said, message_id)
                    rest = held.rest(said.content)
                    if not opened and (rest or not said.tool_calls):
                        opened = True
                        for payload in opening:
                            yield event(payload)
                    if rest:
                        yield event({"type": "response.output_text.delta", **at, "delta": rest, "logprobs": []})
                    if opened:
                        if done["output"][0]["type"] != "message":  # only blanks were sent before the calls
                            done["output"].insert(0, output_message(message_id, said, held.sent + rest))
                        message = done["output"][0]
                        text = message["content"][0]["text"]
                        yield event({"type": "response.output_text.done", **at, "text": text, "logprobs": []})
                        yield event({"type": "response.content_part.done", **at, "part": message["content"][0]})
                        yield event({"type": "response.output_item.done", "output_index": 0, "item": message})
                    for payload in function_call_events(list(said.tool_calls), 1 if opened else 0):
                        yield event(payload)
                    ended = "response.completed" if done["status"] == "completed" else "response.incomplete"
                    yield event({"type": ended, "response": done})
    except ApiError as error:
        yield event({"type": "error", "code": error.code or error.kind, "message": error.message, "param": error.param})
