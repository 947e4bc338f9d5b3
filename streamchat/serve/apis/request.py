"""A request as every API reads it: ChatRequest (what a Turn answers), the ApiError a bad one gets, the body
parsed within bounds, and the checks every API's reader shares.

    body = parse_body(raw)                                  # ApiError (400): not plain JSON the server can hold
    refuse_unknown(body, ACCEPTED, IGNORED, NEUTRAL)        # ApiError (400) naming the first field not read
    settings = request_settings(body)                       # by the chat API's names: max_tokens, temperature, stop
    settings = renamed_settings(body, {"max_tokens": "max_output_tokens", ...})   # by another API's
    text = checked_text(value, "input[0].content", limits)
    held = json_format(described, "response_format.json_schema")      # the JSON schema a reply is held to
    text_format = text_format_field(body.get("text"))       # the Responses API's text.format, as sent
    held = held_format(text_format)                         # the JSON it asks for, None for text

The body is parsed by `parse_body`: invalid UTF-8, NaN and Infinity, integers of more
than MAX_INTEGER_DIGITS digits and nesting too deep for the parser are 400s, and lone
surrogates in text (valid JSON escapes that no encoder can write) become U+FFFD. Each
API's reader (openai_chat, openai_responses, anthropic_messages) runs these checks on its
own fields, so a bad value is refused in the same words, naming the field as it sent it.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from streamchat import defaults
from streamchat.conversation.message import Message, ToolResult
from streamchat.errors import ConfigError
from streamchat.generation.constraint import JsonFormat
from streamchat.generation.settings import MAX_SEED, SAMPLING_RULES, GenerationChanges

# Sampling settings a request may set, read as numbers: OpenAI's and the common extensions (vLLM, llama.cpp).
NUMERIC_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# Every setting a request may set, as the session names it; one a request leaves out gets the server's.
REQUEST_SETTINGS = ("max_new_tokens", *NUMERIC_SETTINGS, "top_k", "seed", "stop")
MAX_STOP_STRINGS = 4  # as OpenAI
JSON_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI
# No field takes a longer integer (a seed has at most 20 digits); Python's int() refuses past 4,300.
MAX_INTEGER_DIGITS = 20
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")

# A reply's format as the Responses API's text.format says it, plain text where it says none.
TEXT_FORMAT = {"type": "text"}
# What each kind of text.format may carry: a JSON schema's name, schema, description and strict.
FORMAT_KEYS = {
    "text": frozenset({"type"}),
    "json_object": frozenset({"type"}),
    "json_schema": frozenset({"type", "name", "schema", "description", "strict"}),
}


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.kind = kind
        self.code = code or None

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class Limits:
    """What one request may carry."""

    body_bytes: int = defaults.SERVE_MAX_BODY_BYTES
    messages: int = defaults.SERVE_MAX_MESSAGES
    message_chars: int = defaults.SERVE_MAX_MESSAGE_CHARS


@dataclass(frozen=True)
class ChatRequest:
    """A chat completion request, checked: the conversation so far, the new input, how to answer."""

    model: str | None
    system: str | None  # None: the server's own system prompt, if it has one
    history: list[Message]  # prompt turns (user, tool results) and replies before the new input, alternating
    # The new input as the transcript holds it: the user's message, or the results of the last reply's calls (a
    # tool entry, with the user's words after them where there are some).
    prompt: Message
    stream: bool = False
    include_usage: bool = False
    # The generation settings the request sets, typed; the rest are the server's.
    settings: GenerationChanges = field(default_factory=GenerationChanges)
    # With each token, its log-probability and this many of the likeliest alternatives'; None: not asked for.
    logprobs: int | None = None
    json_format: JsonFormat | None = None  # the reply is one JSON value of this schema (response_format)
    tools: list[dict[str, Any]] | None = None  # the conversation's tools (OpenAI's function specs), in its first turn
    tool_choice: str = "none"  # "none" (no calls read), "auto", "required", or the one tool's name the reply calls
    parallel_tool_calls: bool = True

    @property
    def text(self) -> str:
        """The user's words: the new message, or those sent after the tool results ("" for none)."""
        return self.prompt.get("user_text", "") if self.prompt["role"] == "tool" else self.prompt["content"]

    @property
    def tool_results(self) -> list[ToolResult] | None:
        """The results of the last reply's calls the new input hands it; None: the input is a user message."""
        return self.prompt.get("tool_results", []) if self.prompt["role"] == "tool" else None


class _TooLong:
    """An integer of more digits than any field takes: no field accepts it, so its field's check names it."""


def parse_body(body: bytes) -> object:
    """The JSON in a request body; ApiError (400) for anything that is not plain JSON the server can hold."""
    try:
        return json.loads(body, parse_int=_bounded_int, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError) as error:
        raise ApiError(400, f"the request body is not valid JSON ({error})") from None


def _bounded_int(text: str) -> int | _TooLong:
    return _TooLong() if len(text.lstrip("-")) > MAX_INTEGER_DIGITS else int(text)


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def encodable(text: str) -> str:
    """`text` with each lone surrogate (a JSON escape like \\ud800 that is no character) made U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def same_json(value: object, neutral: object) -> bool:
    """Equal as JSON values: 0 is not false."""
    return type(value) is type(neutral) and value == neutral


def request_settings(body: dict[str, Any]) -> GenerationChanges:
    """The generation settings the request sets, each checked and named by the field that sets it."""
    settings = GenerationChanges()
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            value = whole_number(body[name])
            if value is None or not SAMPLING_RULES["max_new_tokens"].accepts(value):
                raise ApiError(400, f"{name!r} must be a whole number >= 1", param=name)
            settings["max_new_tokens"] = value
    for name in NUMERIC_SETTINGS:
        if body.get(name) is not None:
            value = body[name]
            rule = SAMPLING_RULES[name]
            if not is_number(value) or not rule.accepts(value):
                raise ApiError(400, f"{name!r} must be a number {rule.limits}", param=name)
            settings[name] = float(value)  # type: ignore[literal-required]  # name is one of NUMERIC_SETTINGS
    if body.get("top_k") is not None:
        top_k = whole_number(body["top_k"])
        if top_k is None or not SAMPLING_RULES["top_k"].accepts(top_k):
            raise ApiError(400, f"'top_k' must be a whole number {SAMPLING_RULES['top_k'].limits}", param="top_k")
        settings["top_k"] = top_k
    if body.get("seed") is not None:
        seed = whole_number(body["seed"])
        if seed is None or not 0 <= seed <= MAX_SEED:
            raise ApiError(400, f"'seed' must be a whole number from 0 to {MAX_SEED}", param="seed")
        settings["seed"] = seed
    if body.get("stop") is not None:
        settings["stop"] = _stop(body["stop"])
    return settings


def _stop(value: object) -> tuple[str, ...]:
    """The strings that end the reply, as sent (an empty list: none)."""
    stops = [value] if isinstance(value, str) else value
    if (
        not isinstance(stops, list)
        or len(stops) > MAX_STOP_STRINGS
        or not all(isinstance(text, str) and text for text in stops)
    ):
        raise ApiError(400, f"'stop' must be a non-empty string or a list of up to {MAX_STOP_STRINGS}", param="stop")
    return tuple(encodable(text) for text in stops)


def boolean_field(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{param or name!r} must be true or false", param=param or name)
    return value


def whole_number(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def refuse_unknown(
    body: dict[str, Any],
    accepted: Collection[str],
    ignored: Collection[str] = (),
    neutral: Mapping[str, tuple[object, ...]] | None = None,
) -> None:
    """Refuse, by name, a field of `body` this API does not read: neither `accepted`, nor `ignored` (labels taken
    and unused), nor at one of its `neutral` values (what changes nothing, which common clients send by
    default). A null field is as good as none."""
    for name, value in body.items():
        if name in accepted or name in ignored or value is None:
            continue
        values = (neutral or {}).get(name)
        if values is None:
            raise ApiError(400, f"{name!r} is not supported by streamchat", param=name, code="unsupported_parameter")
        if not any(same_json(value, allowed) for allowed in values):
            said = " or ".join(json.dumps(allowed) for allowed in values)
            raise ApiError(
                400,
                f"{name!r} is not supported by streamchat: only {said} (what changes nothing) is accepted",
                param=name,
                code="unsupported_parameter",
            )


def renamed_settings(body: dict[str, Any], names: Mapping[str, str]) -> GenerationChanges:
    """The generation settings in `body`, whose fields `names` maps from the chat API's names (max_tokens,
    temperature, top_p, top_k, stop, ...) to this API's; a bad value's ApiError names this API's field."""
    chat_body = {chat: body[own] for chat, own in names.items() if own in body}
    try:
        return request_settings(chat_body)
    except ApiError as error:
        if error.param is None or error.param not in names:
            raise
        own = names[error.param]
        raise ApiError(400, error.message.replace(repr(error.param), repr(own), 1), param=own) from None


def part_text(part: dict[str, Any], at: str, keys: Collection[str]) -> str:
    """A text part's (or block's) text, its keys all among `keys`; ApiError naming the key or the text that is
    wrong."""
    extra = sorted(set(part) - set(keys))
    if extra:
        raise ApiError(400, f"{at}.{extra[0]} is not supported by streamchat", param=f"{at}.{extra[0]}")
    if not isinstance(part.get("text"), str):
        raise ApiError(400, f"{at}.text must be a string", param=f"{at}.text")
    return str(part["text"])


def checked_text(value: object, where: str, limits: Limits) -> str:
    """A message's text, no longer than a message may be, each lone surrogate made U+FFFD; ApiError naming
    `where` when it is no string or too long."""
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a string", param=where)
    if len(value) > limits.message_chars:
        raise ApiError(400, f"{where} is longer than {limits.message_chars:,} characters", param=where)
    return encodable(value)


def json_format(described: dict[str, Any], where: str) -> JsonFormat:
    """The JSON schema a reply is held to, as an API describes it at `where` (its name, schema and strict); ApiError
    (400) naming the field that is wrong (a schema the grammar cannot hold says why)."""
    name, schema, strict = described.get("name", ""), described.get("schema"), described.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ApiError(400, f"'{where}.strict' must be true or false", param=f"{where}.strict")
    if not isinstance(name, str) or not JSON_SCHEMA_NAME.fullmatch(name):
        raise ApiError(400, f"'{where}.name' must be 1 to 64 letters, digits, '_' or '-'", param=f"{where}.name")
    if schema is not None and not isinstance(schema, dict):
        raise ApiError(400, f"'{where}.schema' must be a JSON schema (an object)", param=f"{where}.schema")
    try:
        # Strict or not, the reply is held to the schema: a grammar either holds a token or does not.
        return JsonFormat(schema, name)
    except ConfigError as error:
        raise ApiError(400, f"'{where}.schema': {error}", param=f"{where}.schema") from None


def text_format_field(value: object) -> dict[str, Any]:
    """The Responses API's `text.format` as sent (plain text where it says none); a verbosity is not
    implemented."""
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


def held_format(text_format: dict[str, Any]) -> JsonFormat | None:
    """The JSON schema `text.format` holds the reply to; None for text."""
    if text_format["type"] == "text":
        return None
    if text_format["type"] == "json_object":
        return JsonFormat()
    return json_format(text_format, "text.format")
