"""Tools on OpenAI's chat completions API: the request's `tools`, `tool_choice` and `parallel_tool_calls`, the
history's tool calls and results, and the calls as a reply or a stream says them.

    tools = tools_field(body.get("tools"))                        # checked function specs; None: no tools
    choice = tool_choice_field(body.get("tool_choice"), tools)    # "none", "auto", "required" or a tool's name
    calls = tool_calls_field(message["tool_calls"], "messages[3].tool_calls", limits)
    held = HeldText(family)                                       # a stream's text, a possible call held back

Each field is checked as the chat API's others are: a bad value is a 400 naming it
(`tools[2].function.name`). The tools are part of a conversation's first turn (its sinks):
other tools are another conversation (streamchat.serve.matching files them).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from streamchat.conversation.message import ToolCall
from streamchat.serve.apis.request import ApiError, Limits, checked_text
from streamchat.serve.apis.tool_calls import Family, call_start

MAX_TOOLS = 128  # as OpenAI
MAX_CALLS = 128  # calls in one reply of a history
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI
CHOICES = ("none", "auto", "required")


def listed_tools(value: object, kind: str) -> list[Any] | None:
    """A request's `tools`, checked to be a list of up to MAX_TOOLS (`kind`, as the API calls them); None for none
    (or []). Each API's reader checks the items."""
    if value is None or value == []:
        return None
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise ApiError(400, f"'tools' must be a list of up to {MAX_TOOLS} {kind}", param="tools")
    return value


def tools_field(value: object) -> list[dict[str, Any]] | None:
    """The request's tools, each `{"type": "function", "function": {"name", "description", "parameters",
    "strict"}}` as sent; None for none (or [])."""
    tools = listed_tools(value, "functions")
    if tools is None:
        return None
    names: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or set(tool) != {"type", "function"}:
            raise ApiError(400, f'{where} must be {{"type": "function", "function": {{...}}}}', param=where)
        function = tool["function"]
        where += ".function"
        if not isinstance(function, dict) or set(function) - {"name", "description", "parameters", "strict"}:
            raise ApiError(400, f"{where} must be an object with a name (description, parameters, strict)", param=where)
        names.add(tool_name(function.get("name"), where, names))
        if not isinstance(function.get("description", ""), str):
            raise ApiError(400, f"{where}.description must be a string", param=f"{where}.description")
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f"{where}.parameters must be a JSON schema (an object)", param=f"{where}.parameters")
        if not isinstance(function.get("strict", False), bool):
            raise ApiError(400, f"{where}.strict must be true or false", param=f"{where}.strict")
    return tools


def tool_name(name: object, where: str, taken: Collection[str]) -> str:
    """A tool's name (`where`.name), checked: OpenAI's characters, and no earlier tool's (in `taken`)."""
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ApiError(400, f"{where}.name must be 1 to 64 letters, digits, '_' or '-'", param=f"{where}.name")
    if name in taken:
        raise ApiError(400, f"{where}.name {name!r} names another tool too", param=f"{where}.name")
    return name


def tool_choice_field(value: object, tools: list[dict[str, Any]] | None) -> str:
    """ "none", "auto", "required", or the name of the one tool the reply must call (OpenAI's
    {"type": "function", "function": {"name": ...}}). Left out: "auto" with tools, "none" without."""
    if value is None:
        return "auto" if tools else "none"
    if value in CHOICES:
        if value == "required" and not tools:
            raise ApiError(400, "'tool_choice' \"required\" needs 'tools'", param="tool_choice")
        return str(value)
    named = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = named.get("name") if isinstance(named, dict) else None
    if not isinstance(name, str):
        raise ApiError(
            400,
            '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
            param="tool_choice",
        )
    if name not in {tool["function"]["name"] for tool in tools or []}:
        raise ApiError(400, f"'tool_choice' names {name!r}, which is not one of 'tools'", param="tool_choice")
    return name


def tool_calls_field(value: object, where: str, limits: Limits) -> list[ToolCall]:
    """An assistant message's tool calls as a client sends them back (ids, names, arguments as JSON text)."""
    if not isinstance(value, list) or not value or len(value) > MAX_CALLS:
        raise ApiError(400, f"{where} must be a list of 1 to {MAX_CALLS} tool calls", param=where)
    calls: list[ToolCall] = []
    for index, call in enumerate(value):
        at = f"{where}[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(call, dict) or call.get("type", "function") != "function" or not isinstance(function, dict):
            raise ApiError(
                400, f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', param=at
            )
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id or len(call_id) > 256:
            raise ApiError(400, f"{at}.id must be a non-empty string", param=f"{at}.id")
        name = function.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise ApiError(400, f"{at}.function.name must be a function's name", param=f"{at}.function.name")
        arguments = checked_text(function.get("arguments"), f"{at}.function.arguments", limits)
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return calls


def message_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A reply's calls as its message says them."""
    return [{"id": c["id"], "type": "function", "function": dict(c["function"])} for c in calls]


def call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    """A stream's deltas for `calls`: each call's index, id, type and name, then its arguments."""
    deltas = []
    for index, call in enumerate(calls):
        function = call["function"]
        opened = {
            "index": index,
            "id": call["id"],
            "type": "function",
            "function": {"name": function["name"], "arguments": ""},
        }
        deltas.append({"tool_calls": [opened]})
        deltas.append({"tool_calls": [{"index": index, "function": {"arguments": function["arguments"]}}]})
    return deltas


@dataclass
class HeldText:
    """A streamed reply's text as its client may be sent it: text that may begin a tool call is held back until
    the reply ends, then the calls read from it are sent as calls, and the text outside them as text."""

    family: Family | None  # None: the reply is text, sent as it comes
    text: str = ""
    sent: str = field(default="")

    def add(self, delta: str) -> str:
        """The reply's next text: what of it may be sent now."""
        self.text += delta
        if self.family is None:  # no calls are read from this reply: nothing to hold, nothing to scan
            self.sent += delta
            return delta
        start = call_start(self.family, self.text)
        ready = self.text if start is None else self.text[:start]
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        new, self.sent = ready[len(self.sent) :], ready
        return new

    def rest(self, content: str | None) -> str:
        """At the reply's end, `content` the text outside its calls (None: no calls, the text whole): what of it
        was not sent yet."""
        whole = self.text if content is None else content
        sent = self.sent if whole.startswith(self.sent) else self.sent.lstrip()
        return whole[len(sent) :] if whole.startswith(sent) else ""
