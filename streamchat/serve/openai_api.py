"""The OpenAI chat API's shapes: a request read and checked, replies and errors as OpenAI writes them.

    request = chat_request(json.loads(body), limits)   # ApiError (400) names the field that is wrong
    completion(...), chunk(...), usage_chunk(...)       # the JSON OpenAI's clients parse

Only what streamchat implements is accepted. A field it does not implement is accepted at
the value that changes nothing (`response_format: {"type": "text"}`,
`tools: []`, ...), since common clients send those by default; any other value, or an
unknown field, is refused by name rather than silently ignored.

The body is parsed by `parse_body`: invalid UTF-8, NaN and Infinity, integers of more
than MAX_INTEGER_DIGITS digits and nesting too deep for the parser are 400s, and lone
surrogates in text (valid JSON escapes that no encoder can write) become U+FFFD.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from streamchat import defaults
from streamchat.conversation.message import Message, Role
from streamchat.generation.events import TokenLogprob
from streamchat.generation.settings import MAX_SEED, SAMPLING_RULES, GenerationChanges

# Sampling settings a request may set, read as numbers: OpenAI's and the common extensions (vLLM, llama.cpp).
NUMERIC_SETTINGS = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
# Every setting a request may set, as the session names it; one a request leaves out gets the server's.
REQUEST_SETTINGS = ("max_new_tokens", *NUMERIC_SETTINGS, "top_k", "seed", "stop")
# The fields a chat completion request may carry and streamchat reads (max_tokens sets max_new_tokens).
ACCEPTED_FIELDS = frozenset(
    {
        "model",
        "messages",
        "stream",
        "stream_options",
        "max_tokens",
        "max_completion_tokens",
        "n",
        "logprobs",
        "top_logprobs",
        *REQUEST_SETTINGS,
    }
    - {"max_new_tokens"}
)
MAX_TOP_LOGPROBS = 20  # as OpenAI
# Labels a client may attach, accepted and unused: `user` and `metadata` name who asks, `store`
# asks OpenAI to keep the reply (streamchat journals every conversation anyway).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier"})
# Fields streamchat does not implement, accepted at the values that change nothing.
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
    "response_format": ({"type": "text"},),
    "logit_bias": ({},),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "parallel_tool_calls": (True, False),
}
MAX_STOP_STRINGS = 4  # as OpenAI
# No field takes a longer integer (a seed has at most 20 digits); Python's int() refuses past 4,300.
MAX_INTEGER_DIGITS = 20
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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
    """A chat completion request, checked: the conversation so far, the new user message, how to answer."""

    model: str | None
    system: str | None  # None: the server's own system prompt, if it has one
    history: list[Message]  # user and assistant turns before the new message, alternating
    text: str  # the new user message
    stream: bool = False
    include_usage: bool = False
    # The generation settings the request sets, typed; the rest are the server's.
    settings: GenerationChanges = field(default_factory=GenerationChanges)
    # With each token, its log-probability and this many of the likeliest alternatives'; None: not asked for.
    logprobs: int | None = None


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


def chat_request(body: object, limits: Limits) -> ChatRequest:
    """The request in `body` (parsed JSON); ApiError (400) names the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name in ACCEPTED_FIELDS or name in IGNORED_FIELDS or value is None:
            continue
        if name not in NEUTRAL_VALUES:
            raise ApiError(400, f"{name!r} is not supported by streamchat", param=name, code="unsupported_parameter")
        if not any(_same_json(value, neutral) for neutral in NEUTRAL_VALUES[name]):
            allowed = " or ".join(json.dumps(neutral) for neutral in NEUTRAL_VALUES[name])
            raise ApiError(
                400,
                f"{name!r} is not supported by streamchat: only {allowed} (what changes nothing) is accepted",
                param=name,
                code="unsupported_parameter",
            )
    n = body.get("n")
    if n is not None and (_integer(n) is None or n != 1):
        raise ApiError(400, "streamchat writes one choice per request: 'n' must be 1", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    system, history, text = _messages(body.get("messages"), limits)
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "'stream_options' may only hold include_usage", param="stream_options")
    include_usage = _boolean(options or {}, "include_usage", "stream_options.include_usage")
    return ChatRequest(model, system, history, text, stream, include_usage, _settings(body), _logprobs(body))


def _logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives' log-probabilities each token carries (`top_logprobs`), None when `logprobs` is not
    true."""
    wanted = _boolean(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if _integer(top) is None or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if not wanted and top:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return top if wanted else None


def _messages(value: object, limits: Limits) -> tuple[str | None, list[Message], str]:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if len(value) > limits.messages:
        raise ApiError(400, f"at most {limits.messages} messages per request", param="messages")
    system_parts: list[str] = []
    turns: list[Message] = []
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with a role and content", param=where)
        role = message.get("role")
        content = _content(message.get("content"), f"{where}.content", limits)
        if role in ("system", "developer") and not turns:
            system_parts.append(content)
            continue
        expected: Role = "user" if len(turns) % 2 == 0 else "assistant"
        if role != expected:
            raise ApiError(
                400,
                f"{where}.role is {role!r}, expected {expected!r}: after the system prompt, "
                "user and assistant messages alternate, starting with the user",
                param=f"{where}.role",
            )
        extra = set(message) - {"role", "content", "name"}
        if extra:
            name = sorted(extra)[0]
            raise ApiError(400, f"{where}.{name} is not supported by streamchat", param=f"{where}.{name}")
        turns.append({"role": expected, "content": content})
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    system = "\n\n".join(system_parts) if system_parts else None
    return system, turns[:-1], turns[-1]["content"]


def _content(value: object, where: str, limits: Limits) -> str:
    """A message's text: a string, or a list of text parts (joined)."""
    if isinstance(value, list):
        parts = []
        for part in value:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}: streamchat reads only text parts", param=where)
            parts.append(part["text"])
        value = "".join(parts)
    if not isinstance(value, str):
        raise ApiError(400, f"{where} must be a string", param=where)
    if len(value) > limits.message_chars:
        raise ApiError(400, f"{where} is longer than {limits.message_chars:,} characters", param=where)
    return _encodable(value)


def _encodable(text: str) -> str:
    """`text` with each lone surrogate (a JSON escape like \\ud800 that is no character) made U+FFFD."""
    return _LONE_SURROGATE.sub("\ufffd", text)


def _same_json(value: object, neutral: object) -> bool:
    """Equal as JSON values: 0 is not false."""
    return type(value) is type(neutral) and value == neutral


def _settings(body: dict[str, Any]) -> GenerationChanges:
    """The generation settings the request sets, each checked and named by the field that sets it."""
    settings = GenerationChanges()
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None:
            value = _integer(body[name])
            if value is None or not SAMPLING_RULES["max_new_tokens"].accepts(value):
                raise ApiError(400, f"{name!r} must be a whole number >= 1", param=name)
            settings["max_new_tokens"] = value
    for name in NUMERIC_SETTINGS:
        if body.get(name) is not None:
            value = body[name]
            rule = SAMPLING_RULES[name]
            if not _is_number(value) or not rule.accepts(value):
                raise ApiError(400, f"{name!r} must be a number {rule.limits}", param=name)
            settings[name] = float(value)  # type: ignore[literal-required]  # name is one of NUMERIC_SETTINGS
    if body.get("top_k") is not None:
        top_k = _integer(body["top_k"])
        if top_k is None or not SAMPLING_RULES["top_k"].accepts(top_k):
            raise ApiError(400, f"'top_k' must be a whole number {SAMPLING_RULES['top_k'].limits}", param="top_k")
        settings["top_k"] = top_k
    if body.get("seed") is not None:
        seed = _integer(body["seed"])
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
    return tuple(_encodable(text) for text in stops)


def _boolean(body: dict[str, Any], name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"{param or name!r} must be true or false", param=param or name)
    return value


def _integer(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# ---- what the server answers ---------------------------------------------------------------------


# Why a reply ended (streamchat.generation.events.StopReason), as finish_reason says it. OpenAI has no
# word for a reply the server cut short; "interrupted" is the journal's, and not "stop", which would
# tell the client the reply is whole.
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "interrupted": "interrupted"}


def finish_reason(stop_reason: str) -> str:
    """OpenAI's finish_reason for a reply that ended for `stop_reason`."""
    return FINISH_REASONS[stop_reason]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion(
    reply_id: str,
    created: int,
    model: str,
    text: str,
    finish: str,
    used: dict[str, Any],
    logprobs: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    message = {"role": "assistant", "content": text}
    choice = {"index": 0, "message": message, "logprobs": _logprobs_body(logprobs), "finish_reason": finish}
    return {
        "id": reply_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [choice],
        "usage": used,
    }


def chunk(
    reply_id: str,
    created: int,
    model: str,
    delta: dict[str, str],
    finish: str | None = None,
    logprobs: list[TokenLogprob] | None = None,
) -> dict[str, Any]:
    return {
        "id": reply_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [{"index": 0, "delta": delta, "logprobs": _logprobs_body(logprobs), "finish_reason": finish}],
    }


def _logprobs_body(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI's `logprobs` of a choice: each token's text, log-probability and bytes (its text's, in UTF-8), and
    its alternatives'; None where they were not asked for."""
    if logprobs is None:
        return None

    def entry(text: str, logprob: float) -> dict[str, Any]:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = [
        {**entry(token.text, token.logprob), "top_logprobs": [entry(text, value) for text, value in token.top]}
        for token in logprobs
    ]
    return {"content": content, "refusal": None}


def usage_chunk(reply_id: str, created: int, model: str, used: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": reply_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [],
        "usage": used,
    }


def model_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "streamchat"}]}
