"""A message of a conversation, as the chat template, the journal and the OpenAI API all write it:
{"role": "user", "content": "Hello!"}. A TypedDict, not a class: chat templates read messages as dicts.

A transcript alternates a prompt turn and a reply. A prompt turn is a user message, or the results
of the tools the reply before it called: one "tool" entry holding every result (`tool_results`), so
that each reply still follows exactly one prompt. A reply that called tools holds its calls
(`tool_calls`, OpenAI's shape: the arguments as JSON text) and the text outside them as its content.
`template_messages` writes a transcript as chat templates read it (one "tool" message per result,
arguments as objects).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypedDict

from typing_extensions import NotRequired  # in typing from Python 3.11

Role = Literal["system", "user", "assistant", "tool"]


class FunctionCall(TypedDict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(TypedDict):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ToolResult(TypedDict):
    tool_call_id: str
    content: str


class Message(TypedDict):
    role: Role
    content: str  # a tool entry's: its results' text, joined (what recall searches)
    tool_calls: NotRequired[list[ToolCall]]  # a reply's calls
    tool_results: NotRequired[list[ToolResult]]  # a "tool" entry's results, in the order of the calls


def tool_results_message(results: list[ToolResult]) -> Message:
    """The prompt turn that hands the last reply the results of its calls."""
    joined = "\n\n".join(result["content"] for result in results)
    return {"role": "tool", "content": joined, "tool_results": [dict(result) for result in results]}  # type: ignore[misc]


def is_prompt(message: Message) -> bool:
    """Whether `message` is a prompt turn (the user's message, or tool results): a reply follows it."""
    return message["role"] in ("user", "tool")


def template_messages(messages: list[Message]) -> list[dict[str, Any]]:
    """`messages` as chat templates read them (transformers' convention): one "tool" message per result, and each
    call's arguments an object (templates write them with `tojson`)."""
    written: list[dict[str, Any]] = []
    for message in messages:
        if message["role"] == "tool":
            written += [{"role": "tool", **result} for result in message.get("tool_results", [])]
        elif "tool_calls" in message:
            calls = [
                {**call, "function": {**call["function"], "arguments": _object(call)}} for call in message["tool_calls"]
            ]
            written.append({"role": message["role"], "content": message["content"], "tool_calls": calls})
        else:
            written.append(dict(message))
    return written


def _object(call: ToolCall) -> object:
    arguments = call["function"]["arguments"]
    try:
        return json.loads(arguments)
    except ValueError:  # not JSON: the template writes the text as it was sent
        return arguments
