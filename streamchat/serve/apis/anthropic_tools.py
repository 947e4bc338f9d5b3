"""Tool use on Anthropic's Messages API: the request's `tools` and `tool_choice`, the history's tool_use and
tool_result blocks, and the calls as a reply's tool_use blocks (whole or streamed).

    tools = tools_field(body.get("tools"))                          # OpenAI's function specs; None: no tools
    choice, parallel = tool_choice_field(body.get("tool_choice"), tools)
    call = tool_use_block(block, "messages[1].content[0]", limits)  # a ToolCall, its id as the Turn filed it
    result = tool_result_block(block, "messages[2].content[0]", calls, results, limits)
    blocks = tool_use_blocks(finished.tool_calls)                   # a reply's calls, as Anthropic writes them

The tools are read into the chat API's shape (name, description, `parameters` from
`input_schema`), so a conversation begun with tools on one API goes on in the other.

Ids: the Turn names each call `call_<hex>` (streamchat.serve.apis.tool_calls), and files the
conversation under those. This API tells them as Anthropic writes them, `toolu_<hex>`, and reads
a `toolu_<hex>` sent back as `call_<hex>`: the same hex both ways, so a client that sends back
what it was told continues the same conversation. Other ids (Mistral's nine letters) go out and
come back as they are. A call's arguments are JSON text in the transcript and an object here:
`input` is that text parsed, and an `input` sent back is written as the Turn wrote it (json.dumps),
so that it reads the same.

A tool_result's `is_error` is in its text as the model reads it ("Error: " before the content),
and a user message may hold text blocks after its tool_result blocks: the user's words after the
results, in the same turn (streamchat.conversation.message: a tool entry's `user_text`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from streamchat.conversation.message import Message, ToolCall, ToolResult, tool_results_message
from streamchat.serve.apis.openai_tools import FUNCTION_NAME, listed_tools, tool_name
from streamchat.serve.apis.request import ApiError, Limits, checked_text, part_text

CHOICE_TYPES = ("auto", "any", "tool", "none")
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control"})
TOOL_USE_KEYS = frozenset({"type", "id", "name", "input", "cache_control"})
TOOL_RESULT_KEYS = frozenset({"type", "tool_use_id", "content", "is_error", "cache_control"})
TEXT_KEYS = frozenset({"type", "text", "cache_control", "citations"})
TOOL_USE_ID = re.compile(r"[A-Za-z0-9_-]{1,256}")  # as Anthropic
OUR_PREFIX, THEIR_PREFIX = "call_", "toolu_"
# Before the text of a tool_result whose `is_error` is true: the chat templates have no other way to say it.
ERROR_PREFIX = "Error: "


def told_id(call_id: str) -> str:
    """A call's id as this API tells it: call_<hex> is toolu_<hex>; any other as it is."""
    return THEIR_PREFIX + call_id[len(OUR_PREFIX) :] if call_id.startswith(OUR_PREFIX) else call_id


def filed_id(tool_use_id: str) -> str:
    """A tool_use id sent back, as the Turn filed it (told_id undone): toolu_<hex> is call_<hex>."""
    if tool_use_id.startswith(THEIR_PREFIX):
        return OUR_PREFIX + tool_use_id[len(THEIR_PREFIX) :]
    return tool_use_id


def tools_field(value: object) -> list[dict[str, Any]] | None:
    """The request's tools (`{"name", "description", "input_schema"}`), as the chat API's function specs; None for
    none (or [])."""
    tools = listed_tools(value, "tools")
    if tools is None:
        return None
    specs: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f'{where} must be {{"name", "description", "input_schema"}}', param=where)
        extra = sorted(set(tool) - TOOL_KEYS)
        if extra:
            raise ApiError(400, f"{where}.{extra[0]} is not supported by streamchat", param=f"{where}.{extra[0]}")
        if tool.get("type", "custom") != "custom":
            raise ApiError(
                400, f"{where}.type is {tool['type']!r}: streamchat runs no server tools", param=f"{where}.type"
            )
        name = tool_name(tool.get("name"), where, {spec["function"]["name"] for spec in specs})
        if not isinstance(tool.get("description", ""), str):
            raise ApiError(400, f"{where}.description must be a string", param=f"{where}.description")
        if not isinstance(tool.get("input_schema"), dict):
            raise ApiError(
                400, f"{where}.input_schema must be a JSON schema (an object)", param=f"{where}.input_schema"
            )
        function: dict[str, Any] = {"name": name}
        if "description" in tool:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        specs.append({"type": "function", "function": function})
    return specs


def tool_choice_field(value: object, tools: list[dict[str, Any]] | None) -> tuple[str, bool]:
    """The ChatRequest's tool_choice ("none", "auto", "required" for any, the tool's name for tool) and whether a
    reply may make several calls (not `disable_parallel_tool_use`). Left out: "auto" with tools, "none" without."""
    if value is None:
        return ("auto" if tools else "none"), True
    kind = value.get("type") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or kind not in CHOICE_TYPES
        or set(value) - {"type", "name", "disable_parallel_tool_use"}
    ):
        raise ApiError(
            400,
            '\'tool_choice\' must be {"type": "auto" | "any" | "tool" | "none", "name"?, "disable_parallel_tool_use"?}',
            param="tool_choice",
        )
    disable = value.get("disable_parallel_tool_use", False)
    if not isinstance(disable, bool):
        raise ApiError(400, "'tool_choice.disable_parallel_tool_use' must be true or false", param="tool_choice")
    if kind in ("auto", "none"):
        return ("auto" if tools and kind == "auto" else "none"), not disable
    if not tools:
        raise ApiError(400, f"'tool_choice' {kind!r} needs 'tools'", param="tool_choice")
    if kind == "any":
        return "required", not disable
    name = value.get("name")
    if name not in {tool["function"]["name"] for tool in tools}:
        raise ApiError(400, f"'tool_choice.name' {name!r} is not one of 'tools'", param="tool_choice.name")
    return str(name), not disable


def _keys(block: dict[str, Any], keys: frozenset[str], at: str) -> None:
    extra = sorted(set(block) - keys)
    if extra:
        raise ApiError(400, f"{at}.{extra[0]} is not supported by streamchat", param=f"{at}.{extra[0]}")


def tool_use_block(block: dict[str, Any], at: str, limits: Limits) -> ToolCall:
    """A reply's tool_use block sent back: the call as the Turn filed it (its id, its arguments' JSON text)."""
    _keys(block, TOOL_USE_KEYS, at)
    tool_use_id = block.get("id")
    if not isinstance(tool_use_id, str) or not TOOL_USE_ID.fullmatch(tool_use_id):
        raise ApiError(400, f"{at}.id must be 1 to 256 letters, digits, '_' or '-'", param=f"{at}.id")
    name = block.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ApiError(400, f"{at}.name must be a tool's name", param=f"{at}.name")
    if not isinstance(block.get("input"), dict):
        raise ApiError(400, f"{at}.input must be an object", param=f"{at}.input")
    arguments = checked_text(json.dumps(block["input"], ensure_ascii=False), f"{at}.input", limits)
    return {"id": filed_id(tool_use_id), "type": "function", "function": {"name": name, "arguments": arguments}}


def tool_result_block(
    block: dict[str, Any], at: str, calls: list[ToolCall], results: list[ToolResult], limits: Limits
) -> ToolResult:
    """A tool_result block: the result of one of `calls` (the reply before it) not answered yet in `results`; its
    content a string or text blocks (joined). With `is_error`, the content is an error's (ERROR_PREFIX before it)."""
    _keys(block, TOOL_RESULT_KEYS, at)
    tool_use_id = block.get("tool_use_id")
    call_id = filed_id(tool_use_id) if isinstance(tool_use_id, str) else None
    if not any(call["id"] == call_id for call in calls):
        raise ApiError(400, f"{at}.tool_use_id matches no tool_use of the reply before it", param=f"{at}.tool_use_id")
    if any(result["tool_call_id"] == call_id for result in results):
        raise ApiError(400, f"{at}.tool_use_id answers a tool_use answered already", param=f"{at}.tool_use_id")
    if not isinstance(block.get("is_error", False), bool):
        raise ApiError(400, f"{at}.is_error must be true or false", param=f"{at}.is_error")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for index, part in enumerate(content):
            where = f"{at}.content[{index}]"
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, f"{where}: streamchat reads only text blocks in a tool_result", param=where)
            texts.append(part_text(part, where, TEXT_KEYS))
        content = "".join(texts)
    content = checked_text(content, f"{at}.content", limits)
    if block.get("is_error"):
        # Said in the text, where the model reads it; and here, where the block is read, so that the journal and the
        # matching of a history resent hold what the model read.
        content = f"{ERROR_PREFIX}{content}" if content else ERROR_PREFIX.rstrip(": ")
    return {"tool_call_id": str(call_id), "content": content}


def results_turn(results: list[ToolResult], calls: list[ToolCall], where: str, text: str = "") -> Message:
    """A user message of tool_result blocks (and `text`, its text blocks after them), as the transcript's tool
    entry: each of the reply's calls answered."""
    answered = {result["tool_call_id"] for result in results}
    missing = [call["id"] for call in calls if call["id"] not in answered]
    if missing:
        raise ApiError(400, f"{where}: the tool_use {told_id(missing[0])!r} before it has no tool_result", param=where)
    return tool_results_message(results, text)


# ---- what the server answers ---------------------------------------------------------------------


def tool_input(call: ToolCall) -> dict[str, Any]:
    """A call's arguments as a tool_use block's `input` (an object; arguments that are none, under "arguments")."""
    arguments = call["function"]["arguments"]
    try:
        value = json.loads(arguments)
    except ValueError:
        value = arguments
    return value if isinstance(value, dict) else {"arguments": value}


def tool_use_blocks(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A reply's calls as its content's tool_use blocks."""
    return [
        {"type": "tool_use", "id": told_id(call["id"]), "name": call["function"]["name"], "input": tool_input(call)}
        for call in calls
    ]


def tool_use_events(calls: list[ToolCall], first: int) -> list[dict[str, Any]]:
    """A stream's events for `calls`, its blocks from index `first`: each block's start (its input empty), its
    input as one input_json_delta, its stop."""
    events: list[dict[str, Any]] = []
    for index, block in enumerate(tool_use_blocks(calls), first):
        events.append({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}})
        partial = json.dumps(block["input"], ensure_ascii=False)
        delta = {"type": "input_json_delta", "partial_json": partial}
        events.append({"type": "content_block_delta", "index": index, "delta": delta})
        events.append({"type": "content_block_stop", "index": index})
    return events
