"""Function calling on OpenAI's Responses API: the request's `tools` and `tool_choice`, the input's function_call
and function_call_output items, and a reply's calls as function_call output items (whole or streamed).

    tools = tools_field(body.get("tools"))                       # the chat API's function specs; None: no tools
    choice = tool_choice_field(body.get("tool_choice"), tools)   # "none", "auto", "required" or a tool's name
    call = function_call_item(item, "input[1]", limits)          # a ToolCall, as the Turn filed it
    result = function_call_output_item(item, "input[2]", limits) # a ToolResult
    turns = InputTurns(going_on); turns.add_call(call, "input[1]"); ...; turns.checked()   # the input's conversation
    answered(results, wheres, calls, "input")                    # ApiError: a result for no call, a call unanswered
    items = function_call_items(finished.tool_calls)             # a reply's calls, as output items
    events = function_call_events(calls, first)                  # ... as a stream says them

The tools are written flat (`{"type": "function", "name", "description", "parameters",
"strict"}`) and read into the chat API's shape, so a conversation begun with tools on one API
goes on in the others. A call's `call_id` is the id the Turn filed it under (`call_<hex>`), its
`arguments` the JSON text the model wrote: sent back as they came, they read as the conversation
holds them. An output item's own `id` is `fc_<the same hex>`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from streamchat.conversation.message import Message, ToolCall, ToolResult, is_prompt, tool_results_message
from streamchat.serve.apis.openai_tools import FUNCTION_NAME, listed_tools, tool_name
from streamchat.serve.apis.request import ApiError, Limits, checked_text, part_text

TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
CHOICES = ("none", "auto", "required")
# An output item fed back carries its id and status (and, from some clients, the SDK's other fields as null).
CALL_KEYS = frozenset({"type", "id", "call_id", "name", "arguments", "status"})
OUTPUT_KEYS = frozenset({"type", "id", "call_id", "output", "status"})
OUTPUT_PART_KEYS = frozenset({"type", "text"})
CALL_ID_LENGTH = 256
OUR_PREFIX, ITEM_PREFIX = "call_", "fc_"


def _extra(item: dict[str, Any], keys: frozenset[str], at: str) -> None:
    """ApiError naming the first key of `item` not among `keys` (a null is as good as none)."""
    extra = sorted(key for key, value in item.items() if key not in keys and value is not None)
    if extra:
        raise ApiError(400, f"{at}.{extra[0]} is not supported by streamchat", param=f"{at}.{extra[0]}")


def tools_field(value: object) -> list[dict[str, Any]] | None:
    """The request's tools (flat, as this API writes them), as the chat API's function specs; None for none."""
    tools = listed_tools(value, "functions")
    if tools is None:
        return None
    specs: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict):
            raise ApiError(400, f'{where} must be {{"type": "function", "name", "parameters", ...}}', param=where)
        if tool.get("type") != "function":
            raise ApiError(
                400,
                f"{where}.type is {tool.get('type')!r}: streamchat runs no server tools, only functions",
                param=f"{where}.type",
            )
        _extra(tool, TOOL_KEYS, where)
        name = tool_name(tool.get("name"), where, {spec["function"]["name"] for spec in specs})
        function: dict[str, Any] = {"name": name}
        for key, kind, said in (
            ("description", str, "a string"),
            ("parameters", dict, "a JSON schema (an object)"),
            ("strict", bool, "true or false"),
        ):
            if tool.get(key) is None:
                continue
            if not isinstance(tool[key], kind):
                raise ApiError(400, f"{where}.{key} must be {said}", param=f"{where}.{key}")
            function[key] = tool[key]
        specs.append({"type": "function", "function": function})
    return specs


def tool_choice_field(value: object, tools: list[dict[str, Any]] | None) -> str:
    """ "none", "auto", "required", or the name of the one tool the reply must call ({"type": "function",
    "name": ...}). Left out: "auto" with tools, "none" without."""
    if value is None:
        return "auto" if tools else "none"
    if value in CHOICES:
        if value == "required" and not tools:
            raise ApiError(400, "'tool_choice' \"required\" needs 'tools'", param="tool_choice")
        return "none" if not tools else str(value)
    if not isinstance(value, dict) or value.get("type") != "function" or set(value) != {"type", "name"}:
        raise ApiError(
            400,
            '\'tool_choice\' must be "none", "auto", "required" or {"type": "function", "name": ...}',
            param="tool_choice",
        )
    name = value["name"]
    if name not in {tool["function"]["name"] for tool in tools or []}:
        raise ApiError(400, f"'tool_choice.name' {name!r} is not one of 'tools'", param="tool_choice.name")
    return str(name)


def echoed_tools(tools: list[dict[str, Any]] | None, choice: str, parallel: bool) -> dict[str, Any]:
    """The response object's tools, tool_choice and parallel_tool_calls: the request's, in this API's shape."""
    flat = [{"type": "function", "strict": None, **tool["function"]} for tool in tools or []]
    said: object = choice if choice in CHOICES else {"type": "function", "name": choice}
    return {"tools": flat, "tool_choice": said, "parallel_tool_calls": parallel}


def _call_id(item: dict[str, Any], at: str) -> str:
    call_id = item.get("call_id")
    if not isinstance(call_id, str) or not call_id or len(call_id) > CALL_ID_LENGTH:
        raise ApiError(400, f"{at}.call_id must be a non-empty string", param=f"{at}.call_id")
    return call_id


def function_call_item(item: dict[str, Any], at: str, limits: Limits) -> ToolCall:
    """A reply's function_call item sent back: the call as the Turn filed it (its call_id, its arguments' text)."""
    _extra(item, CALL_KEYS, at)
    call_id = _call_id(item, at)
    name = item.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise ApiError(400, f"{at}.name must be a function's name", param=f"{at}.name")
    arguments = checked_text(item.get("arguments"), f"{at}.arguments", limits)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def function_call_output_item(item: dict[str, Any], at: str, limits: Limits) -> ToolResult:
    """A function_call_output item: a call's result, its output a string or input_text parts (joined)."""
    _extra(item, OUTPUT_KEYS, at)
    call_id = _call_id(item, at)
    output = item.get("output")
    if isinstance(output, list):
        texts = []
        for index, part in enumerate(output):
            where = f"{at}.output[{index}]"
            if not isinstance(part, dict) or part.get("type") != "input_text":
                raise ApiError(400, f"{where}: streamchat reads only input_text parts in an output", param=where)
            texts.append(part_text(part, where, OUTPUT_PART_KEYS))
        output = "".join(texts)
    return {"tool_call_id": call_id, "content": checked_text(output, f"{at}.output", limits)}


def answered(results: list[ToolResult], wheres: list[str], calls: list[ToolCall], where: str) -> None:
    """ApiError unless `results` (sent at `wheres`) answer each of `calls` (the reply's before them) once; `where`
    names the input a result is missing from."""
    ids = [call["id"] for call in calls]
    seen: set[str] = set()
    for result, at in zip(results, wheres, strict=True):
        call_id = result["tool_call_id"]
        if call_id not in ids:
            raise ApiError(
                400, f"{at}.call_id {call_id!r} matches no function_call of the reply before it", param=f"{at}.call_id"
            )
        if call_id in seen:
            raise ApiError(400, f"{at}.call_id {call_id!r} is answered already", param=f"{at}.call_id")
        seen.add(call_id)
    missing = [call_id for call_id in ids if call_id not in seen]
    if missing:
        raise ApiError(
            400, f"{where}: the function_call {missing[0]!r} before it has no function_call_output", param=where
        )


@dataclass
class InputTurns:
    """The input's conversation, read item by item: a prompt turn (a user message, or the function_call_output
    items answering the reply before, and the user message after them where there is one) and a reply (an
    assistant message, its function_call items) alternating, from the user's; or, `going_on` from a response, from
    the outputs of that response's calls."""

    going_on: bool
    turns: list[Message] = field(default_factory=list)
    begun: list[str] = field(default_factory=list)  # where each turn's first item was sent
    wheres: list[list[str]] = field(default_factory=list)  # where each of a turn's items was sent

    def _open(self, turn: Message, where: str) -> None:
        self.turns.append(turn)
        self.begun.append(where)
        self.wheres.append([where])

    def add_message(self, role: str, content: str, where: str) -> None:
        last = self.turns[-1] if self.turns else None
        if role == "user" and last is not None and last["role"] == "tool" and "user_text" not in last:
            last["user_text"] = content  # the user's words after the outputs (an agent's reminder): the same turn
            return
        expected = "user" if last is None or last["role"] == "assistant" else "assistant"
        if role != expected:
            raise ApiError(
                400,
                f"{where}.role is {role!r}, expected {expected!r}: user and assistant messages alternate, "
                "starting with the user",
                param=f"{where}.role",
            )
        self._open({"role": "user" if role == "user" else "assistant", "content": content}, where)

    def add_call(self, call: ToolCall, where: str) -> None:
        """A function_call: the reply's (the assistant message or calls just before), or a reply of its own."""
        if not self.turns:
            raise ApiError(
                400, f"{where}.type is 'function_call': a reply's call follows its prompt", param=f"{where}.type"
            )
        last = self.turns[-1]
        if last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
            self.wheres[-1].append(where)
        else:
            self._open({"role": "assistant", "content": "", "tool_calls": [call]}, where)

    def add_result(self, result: ToolResult, where: str) -> None:
        """A function_call_output: one of the results answering the reply before."""
        last = self.turns[-1] if self.turns else None
        if last is not None and "user_text" in last:  # as the Messages API: the outputs first, then the words
            raise ApiError(
                400, f"{where}: function_call_output items come before the user's message after them", param=where
            )
        if last is not None and last["role"] == "tool":
            last.setdefault("tool_results", []).append(result)
            self.wheres[-1].append(where)
        elif last.get("tool_calls") if last is not None else self.going_on:
            self._open(tool_results_message([result]), where)
        else:
            raise ApiError(
                400, f"{where}.call_id matches no function_call of the reply before it", param=f"{where}.call_id"
            )

    def checked(self) -> tuple[list[Message], tuple[str, ...]]:
        """The conversation, each reply's calls answered, a prompt turn last; and where its leading outputs were
        sent (answering a previous response's calls, checked once it is read)."""
        turns = self.turns
        if not turns or not is_prompt(turns[-1]):
            raise ApiError(
                400, "the last input item must be the user's message or function_call_output items", param="input"
            )
        for at, turn in enumerate(turns):
            if turn.get("tool_calls") and turns[at + 1]["role"] != "tool":
                where = self.begun[at + 1]
                raise ApiError(400, f"{where}: the function calls before it need their outputs", param=where)
            if turn["role"] == "tool":
                results = turn.get("tool_results", [])
                turns[at] = tool_results_message(results, turn.get("user_text", ""))  # its content: every result's
                if at > 0:
                    answered(results, self.wheres[at], turns[at - 1].get("tool_calls", []), self.begun[at])
        return turns, tuple(self.wheres[0]) if turns[0]["role"] == "tool" else ()


# ---- what the server answers ---------------------------------------------------------------------


def item_id(call_id: str) -> str:
    """A call's output item id: fc_<the hex of its call_<hex>>."""
    return ITEM_PREFIX + call_id.removeprefix(OUR_PREFIX)


def function_call_items(calls: list[ToolCall], status: str = "completed") -> list[dict[str, Any]]:
    """A reply's calls as its output's function_call items."""
    return [
        {
            "id": item_id(call["id"]),
            "type": "function_call",
            "status": status,
            "call_id": call["id"],
            "name": call["function"]["name"],
            "arguments": call["function"]["arguments"],
        }
        for call in calls
    ]


def function_call_events(calls: list[ToolCall], first: int) -> list[dict[str, Any]]:
    """A stream's events for `calls`, their items from output index `first`: each item added (its arguments
    empty), its arguments in one delta, then done, and the item done."""
    events: list[dict[str, Any]] = []
    added = function_call_items(calls, "in_progress")
    for index, (begun, item) in enumerate(zip(added, function_call_items(calls), strict=True), first):
        at = {"item_id": item["id"], "output_index": index}
        events.append({"type": "response.output_item.added", "output_index": index, "item": {**begun, "arguments": ""}})
        events.append({"type": "response.function_call_arguments.delta", **at, "delta": item["arguments"]})
        events.append({"type": "response.function_call_arguments.done", **at, "arguments": item["arguments"]})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
    return events
