"""OpenAI's chat completions API (POST /v1/chat/completions): a request read into a ChatRequest, replies and
chunks as OpenAI writes them.

    request = chat_request(parse_body(body), limits)   # ApiError (400) names the field that is wrong
    completion(...), chunk(...), usage_chunk(...)       # the JSON OpenAI's clients parse

Only what streamchat implements is accepted. A field it does not implement is accepted at
the value that changes nothing (`tools: []`, `logit_bias: {}`, ...), since common clients
send those by default; any other value, or an unknown field, is refused by name rather than
silently ignored. `response_format` holds the reply to a JSON schema
(streamchat.generation.constraint). `tools` describe functions the reply may call
(streamchat.serve.apis.openai_tools reads them, and the history's calls and results).
"""

from __future__ import annotations

from typing import Any, Literal

from streamchat.conversation.message import Message, ToolCall, ToolResult, tool_results_message
from streamchat.generation.constraint import JsonFormat
from streamchat.generation.events import TokenLogprob
from streamchat.serve.apis.openai_tools import message_calls, tool_calls_field, tool_choice_field, tools_field
from streamchat.serve.apis.request import (
    REQUEST_SETTINGS,
    ApiError,
    ChatRequest,
    Limits,
    boolean_field,
    encodable,
    json_format,
    refuse_unknown,
    request_settings,
    whole_number,
)

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
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
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
    "logit_bias": ({},),
}


def chat_request(body: object, limits: Limits) -> ChatRequest:
    """The request in `body` (parsed JSON); ApiError (400) names the first field that is wrong."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    refuse_unknown(body, ACCEPTED_FIELDS, IGNORED_FIELDS, NEUTRAL_VALUES)
    n = body.get("n")
    if n is not None and (whole_number(n) is None or n != 1):
        raise ApiError(400, "streamchat writes one choice per request: 'n' must be 1", param="n")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ApiError(400, "'model' must be a string", param="model")
    tools = tools_field(body.get("tools"))
    tool_choice = tool_choice_field(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, "'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    system, history, prompt = _messages(body.get("messages"), limits)
    held = response_format(body.get("response_format"))
    if held is not None and tool_choice not in ("none", "auto"):
        raise ApiError(400, "'tool_choice' asks for a call, 'response_format' for JSON: not both", param="tool_choice")
    stream = boolean_field(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise ApiError(400, "'stream_options' may only hold include_usage", param="stream_options")
    include_usage = boolean_field(options or {}, "include_usage", "stream_options.include_usage")
    return ChatRequest(
        model,
        system,
        history,
        prompt,
        stream,
        include_usage,
        request_settings(body),
        _logprobs(body),
        held,
        tools,
        tool_choice,
        parallel is not False,
    )


def response_format(value: object) -> JsonFormat | None:
    """The JSON a reply must be (`response_format`: json_object, or json_schema with its schema), None for text."""
    if value is None or value == {"type": "text"}:
        return None
    if value == {"type": "json_object"}:
        return JsonFormat()
    if not isinstance(value, dict) or value.get("type") != "json_schema" or set(value) != {"type", "json_schema"}:
        raise ApiError(
            400,
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
            param="response_format",
        )
    where = "response_format.json_schema"
    described = value["json_schema"]
    if not isinstance(described, dict) or set(described) - {"name", "description", "schema", "strict"}:
        raise ApiError(400, f"'{where}' must be an object with a name and a schema (and strict)", param=where)
    return json_format(described, where)


def _logprobs(body: dict[str, Any]) -> int | None:
    """How many alternatives' log-probabilities each token carries (`top_logprobs`), None when `logprobs` is not
    true."""
    wanted = boolean_field(body, "logprobs")
    top = body.get("top_logprobs")
    if top is None:
        return 0 if wanted else None
    if whole_number(top) is None or not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"'top_logprobs' must be a whole number from 0 to {MAX_TOP_LOGPROBS}", param="top_logprobs")
    if not wanted and top:
        raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return top if wanted else None


def _messages(value: object, limits: Limits) -> tuple[str | None, list[Message], Message]:
    """The system prompt, the history, and the new input (a user message, or the results of the last reply's tool
    calls: the tool messages after it, and the user message after them where there is one, one turn)."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "'messages' must be a non-empty list", param="messages")
    if len(value) > limits.messages:
        raise ApiError(400, f"at most {limits.messages} messages per request", param="messages")
    system_parts: list[str] = []
    turns: list[Message] = []
    results: list[ToolResult] = []  # the tool messages after a reply that called tools
    called = ""  # where that reply is: messages[i]
    for index, message in enumerate(value):
        where = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{where} must be an object with a role and content", param=where)
        role = message.get("role")
        calls = turns[-1].get("tool_calls", []) if turns else []
        if role == "tool" and not _answers(turns):
            raise ApiError(
                400,
                f"{where} is a tool result, but the message before it is no assistant message with tool_calls",
                param=f"{where}.role",
            )
        if role == "tool":
            _only(message, {"role", "content", "tool_call_id", "name"}, where)
            results.append(_tool_result(message, where, calls, results, limits))
            continue
        if results:
            said = ""
            if role == "user":  # the user's words after the results (an agent's reminder): the same turn
                _only(message, {"role", "content", "name"}, where)
                said = _content(message.get("content"), f"{where}.content", limits)
            turns.append(_tool_turn(results, calls, called, said))
            results = []
            if role == "user":
                continue
        content = message.get("content")
        if role == "assistant" and message.get("tool_calls") is not None and content is None:
            content = ""  # a reply that only called tools
        text = _content(content, f"{where}.content", limits)
        if role in ("system", "developer") and not turns:
            system_parts.append(text)
            continue
        expected: Literal["user", "assistant"] = (
            "user" if not turns or turns[-1]["role"] == "assistant" else "assistant"
        )
        if turns and turns[-1].get("tool_calls"):
            raise ApiError(
                400,
                f"{where}.role is {role!r}: the tool calls before it need their results first (role 'tool')",
                param=f"{where}.role",
            )
        if role != expected:
            raise ApiError(
                400,
                f"{where}.role is {role!r}, expected {expected!r}: after the system prompt, "
                "user and assistant messages alternate, starting with the user",
                param=f"{where}.role",
            )
        _only(message, {"role", "content", "name", *(("tool_calls",) if role == "assistant" else ())}, where)
        turn: Message = {"role": expected, "content": text}
        if message.get("tool_calls") is not None:
            turn["tool_calls"] = tool_calls_field(message["tool_calls"], f"{where}.tool_calls", limits)
            called = where
        turns.append(turn)
    if results:
        turns.append(_tool_turn(results, turns[-1].get("tool_calls", []), called))
    if not turns or turns[-1]["role"] == "assistant":
        raise ApiError(400, "the last message must be the user's, or tool results", param="messages")
    system = "\n\n".join(system_parts) if system_parts else None
    return system, turns[:-1], turns[-1]


def _answers(turns: list[Message]) -> bool:
    """Whether a tool message may come next: the last message is a reply that called tools."""
    return bool(turns) and bool(turns[-1].get("tool_calls"))


def _only(message: dict[str, Any], fields: set[str], where: str) -> None:
    extra = set(message) - fields
    if extra:
        name = sorted(extra)[0]
        raise ApiError(400, f"{where}.{name} is not supported by streamchat", param=f"{where}.{name}")


def _tool_result(
    message: dict[str, Any], where: str, calls: list[ToolCall], results: list[ToolResult], limits: Limits
) -> ToolResult:
    call_id = message.get("tool_call_id")
    if not any(call["id"] == call_id for call in calls):
        raise ApiError(
            400, f"{where}.tool_call_id matches no call of the reply before it", param=f"{where}.tool_call_id"
        )
    if any(result["tool_call_id"] == call_id for result in results):
        raise ApiError(400, f"{where}.tool_call_id answers a call answered already", param=f"{where}.tool_call_id")
    return {"tool_call_id": str(call_id), "content": _content(message.get("content"), f"{where}.content", limits)}


def _tool_turn(results: list[ToolResult], calls: list[ToolCall], called: str, text: str = "") -> Message:
    """The tool messages after a reply, as one turn (with `text`, the user message after them): each of its calls
    answered."""
    answered = {result["tool_call_id"] for result in results}
    missing = [call["id"] for call in calls if call["id"] not in answered]
    if missing:
        raise ApiError(400, f"{called}.tool_calls: the call {missing[0]!r} has no result", param=f"{called}.tool_calls")
    return tool_results_message(results, text)


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
    return encodable(value)


# ---- what the server answers ---------------------------------------------------------------------


# Why a reply ended (streamchat.generation.events.StopReason), as finish_reason says it. OpenAI has no
# word for a reply the server cut short; "interrupted" is the journal's, and not "stop", which would
# tell the client the reply is whole.
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "interrupted": "interrupted"}


def finish_reason(stop_reason: str, called: bool = False) -> str:
    """OpenAI's finish_reason for a reply that ended for `stop_reason` (`called`: with tool calls read from it)."""
    return "tool_calls" if called and stop_reason in ("eos", "stop_string") else FINISH_REASONS[stop_reason]


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
    tool_calls: list[ToolCall] | None = None,
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message = {"role": "assistant", "content": text or None, "tool_calls": message_calls(tool_calls)}
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
    delta: dict[str, Any],
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


def model_list(model: str, created: int, meta: dict[str, str | int]) -> dict[str, Any]:
    listed: dict[str, Any] = {"id": model, "object": "model", "created": created, "owned_by": "streamchat"}
    return {"object": "list", "data": [{**listed, "meta": meta} if meta else listed]}
