"""A message of a conversation, as the chat template, the journal and the OpenAI API all write it:
{"role": "user", "content": "Hello!"}. A TypedDict, not a class: chat templates read messages as dicts.

A transcript alternates a prompt turn and a reply. A prompt turn is a user message, or the results
of the tools the reply before it called: one "tool" entry holding every result (`tool_results`), so
that each reply still follows exactly one prompt. A client may send its own words with the results
(an agent's reminder after them): the entry keeps them as `user_text`, written after the results as a
user message, and the model answers the two once. A reply that called tools holds its calls
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
    content: str  # a tool entry's: its results' text, then its user_text, joined (what recall searches)
    tool_calls: NotRequired[list[ToolCall]]  # a reply's calls
    tool_results: NotRequired[list[ToolResult]]  # a "tool" entry's results, in the order of the calls
    user_text: NotRequired[str]  # a "tool" entry's: the user's message sent after the results, in the same turn


def tool_results_message(results: list[ToolResult], text: str = "") -> Message:
    """The prompt turn that hands the last reply the results of its calls, and `text`, the user's message after them
    ("": none, the entry as it always was, so that how it is matched and journaled does not change). Its content is
    what recall searches: the results' text, then the user's."""
    joined = "\n\n".join([*(result["content"] for result in results), *([text] if text else [])])
    copied = [ToolResult(tool_call_id=result["tool_call_id"], content=result["content"]) for result in results]
    message: Message = {"role": "tool", "content": joined, "tool_results": copied}
    if text:
        message["user_text"] = text
    return message


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
            if message.get("user_text"):  # the user's words after the results: a user message of the same turn
                written.append({"role": "user", "content": message["user_text"]})
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
