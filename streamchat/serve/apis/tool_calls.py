"""Tool calls in a model's own words: which syntax a chat template teaches, calls read from a reply's text,
where a call may begin in a reply still streaming, and the grammar that makes a reply a call.

    family = tool_family(chat_format.template)       # "hermes", "llama", "mistral"; None: no syntax streamchat reads
    read = read_tool_calls(family, reply_text)        # its text outside the calls, the calls (OpenAI's shape, new ids)
    held = call_start(family, text_so_far)            # text from there on may be a call: held back while streaming
    lark = tool_call_grammar(family, tools, name, parallel)    # a reply that is one call (or several), always read

The families streamchat meets:
- hermes (Qwen2.5, Hermes, many fine-tunes): <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one
  block a call, anywhere in the reply;
- llama (Llama 3.1+): the whole reply one JSON object {"name": ..., "parameters": {...}}, after
  <|python_tag|> for some;
- mistral: [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...].
Markers that are special tokens (<|python_tag|>, [TOOL_CALLS]) are not in a reply's text (the detokenizer
drops special tokens), so each is optional when reading. A reply whose calls do not parse (malformed JSON, no
name) is text: a client is never handed a call the model did not make whole.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from streamchat.conversation.message import ToolCall
from streamchat.generation.constraint import JSON_LAYOUT

Family = Literal["hermes", "llama", "mistral"]

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_MARKER = "[TOOL_CALLS]"


def tool_family(template: str) -> Family | None:
    """The tool-call syntax a chat template's text teaches its model; None for one streamchat cannot read."""
    if _HERMES_OPEN in template:
        return "hermes"
    if _MISTRAL_MARKER in template:
        return "mistral"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama"
    return None


@dataclass(frozen=True)
class ReadReply:
    """A reply as its client is told it: the text outside its calls, and the calls."""

    content: str
    calls: list[ToolCall] = field(default_factory=list)


def read_tool_calls(family: Family, text: str) -> ReadReply:
    """The calls in a reply's `text`, each with a new id; no calls (the text whole) where none parse."""
    found = {"hermes": _hermes, "llama": _llama, "mistral": _mistral}[family](text)
    if found is None:
        return ReadReply(text)
    content, calls = found
    return ReadReply(content, [_call(name, arguments, family) for name, arguments in calls])


def call_start(family: Family, text: str) -> int | None:
    """Where in `text`, a reply so far, a tool call begins or may yet begin (the rest of the reply decides);
    None where none can. A stream holds the text from there back until the reply ends."""
    if family != "hermes":
        # The reply is its calls from the first character on: held while it may still become one.
        stripped = text.lstrip().removeprefix(_PYTHON_TAG if family == "llama" else _MISTRAL_MARKER)
        start = "{" if family == "llama" else "["
        return 0 if not stripped or stripped.startswith(start) or _PYTHON_TAG.startswith(stripped) else None
    found = text.find(_HERMES_OPEN)
    if found < 0:  # the end of the text may be the start of the marker
        found = next(
            (len(text) - size for size in range(len(_HERMES_OPEN) - 1, 0, -1) if text.endswith(_HERMES_OPEN[:size])), -1
        )
    if found < 0:
        return None
    return len(text[:found].rstrip())  # and the blank before it: it belongs to no text if a call follows


def new_call_id(family: Family | None = None) -> str:
    """A call's id: call_<hex>, as OpenAI writes them; 9 letters and digits for Mistral's templates, which refuse
    any other."""
    return secrets.token_hex(5)[:9] if family == "mistral" else f"call_{secrets.token_hex(12)}"


def tool_call_grammar(family: Family, tools: list[dict[str, Any]], name: str | None, parallel: bool) -> str:
    """A Lark grammar (llguidance's) of a reply that calls `name`, or any of `tools` when None: the family's
    syntax around the JSON of a call, {"name": the tool's, "arguments": its parameters' schema}; several calls
    where `parallel`."""
    chosen = [tool["function"] for tool in tools if name is None or tool["function"]["name"] == name]
    key = "parameters" if family == "llama" else "arguments"
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, key: function.get("parameters") or {"type": "object"}},
            "required": ["name", key],
            "additionalProperties": False,
        }
        for function in chosen
    ]
    call: dict[str, Any] = calls[0] if len(calls) == 1 else {"anyOf": calls}
    if family == "mistral":  # the marker is a special token: left to the model, never in the grammar
        array = {"type": "array", "items": call, "minItems": 1, **({} if parallel else {"maxItems": 1})}
        return f"start: %json {_schema(array)}\n"
    if family == "llama":
        return f"start: %json {_schema(call)}\n"
    more = ' ("\\n"? call)*' if parallel else ""
    return f'start: call{more}\ncall: "<tool_call>" "\\n"? %json {_schema(call)} "\\n"? "</tool_call>"\n'


def _schema(schema: dict[str, Any]) -> str:
    # JSON as the model writes it, as response_format's is (streamchat.generation.constraint).
    return json.dumps({**schema, "x-guidance": JSON_LAYOUT}, ensure_ascii=False)


def _call(name: str, arguments: object, family: Family) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(family), "type": "function", "function": {"name": name, "arguments": text}}


def _named(value: object, key: str = "arguments") -> tuple[str, object] | None:
    """(name, arguments) of one call's JSON, None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters", {})))
    return (value["name"], arguments) if isinstance(arguments, dict | str) else None


def _hermes(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    calls = []
    for match in _HERMES_CALL.finditer(text):
        call = _named(_json(match.group(1)))
        if call is None:
            return None
        calls.append(call)
    if not calls:
        return None
    return _HERMES_CALL.sub("", text).strip(), calls


def _llama(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return None
    calls = []
    for value in _json_values(body.replace(";", " ")):
        call = _named(value, "parameters")
        if call is None:
            return None
        calls.append(call)
    return ("", calls) if calls else None


def _mistral(text: str) -> tuple[str, list[tuple[str, object]]] | None:
    body = text.strip().removeprefix(_MISTRAL_MARKER).strip()
    values = _json(body) if body.startswith("[") else None
    if not isinstance(values, list) or not values:
        return None
    calls = [_named(value) for value in values]
    return None if any(call is None for call in calls) else ("", [call for call in calls if call is not None])


def _json(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _json_values(text: str) -> Iterator[object]:
    """The JSON values `text` holds one after another (whitespace between); a None where the rest is not one."""
    decoder, at = json.JSONDecoder(), 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            yield None
            return
        yield value
        while at < len(text) and text[at].isspace():
            at += 1
