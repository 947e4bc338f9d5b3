"""Saved sessions, read and written: the transcript and settings. Loading replays the transcript through the cache.

Two formats, both read by `read_session`:

- version 1, one JSON document, written whole (`save_session`, for /save FILE);
- version 2, the journal: JSON Lines appended as the conversation goes
  (streamchat.storage.journal writes it). Its first line is a header, every other line a
  record: {"type": "settings" | "system" | "tools" | "user" | "recall" | "reply" | "tool" | "rewind", ...}
  (a server's conversation may call tools: a reply record's `tool_calls`, a "tool" record of their results,
  which is a prompt turn as a user message is). A last line
  without its newline is a write that a kill cut short, and is ignored; record types
  this version does not know are skipped, so later versions can add their own.

Both hold a conversation's text half (streamchat.conversation.state); its tensors go in
a cache state file beside the session file (streamchat.storage.cache_file). The settings are
text in the files, as `/set` takes them (`settings_text`); SavedSession.state() reads them back.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from streamchat import __version__
from streamchat.conversation.message import Message, ToolCall, ToolResult, is_prompt, tool_results_message
from streamchat.conversation.state import ConversationState, RecalledNote, TensorState
from streamchat.errors import SessionFileError
from streamchat.generation.settings import GenerationChanges, GenerationSettings, parse_setting
from streamchat.storage.durable import write_durably

FORMAT = "streamchat-session"
VERSION = 1  # the JSON document
JOURNAL_VERSION = 2  # the JSON Lines journal


@dataclass(frozen=True)
class SavedSession:
    messages: list[Message]
    system_prompt: str | None
    # name -> value as /set takes it, as the file holds them: state() reads them.
    settings: dict[str, str]
    eviction: str
    model: str | None
    # A journal's last user message, when the session ended before its reply did.
    unanswered: str | None = None
    # Its last message is a reply that was stopped (a stop asked for, a client gone): whoever was reading it may
    # hold any start of it.
    last_reply_stopped: bool = False
    version: int = VERSION  # the format it was read from
    # The notes recall read before user messages (streamchat.conversation.recall), by message index.
    recalled: dict[int, RecalledNote] = field(default_factory=dict)
    tools: list[dict[str, Any]] | None = None  # the tools its first turn describes

    def state(self, unsaid: GenerationSettings, tensors: TensorState | None = None) -> ConversationState:
        """The conversation saved, as a value to restore a session to (with `tensors`, exactly). Its settings
        are `unsaid` changed as the file's text says: a file saved before a setting existed leaves that one
        as it is. ConfigError names a setting this streamchat does not take."""
        changes = GenerationChanges()
        for name, text in self.settings.items():
            changes.update(parse_setting(name, text))
        settings = unsaid.changed(changes)
        return ConversationState(
            list(self.messages), self.system_prompt, settings, self.eviction, tensors, dict(self.recalled), self.tools
        )


def settings_text(state: ConversationState) -> dict[str, str]:
    """The settings of `state` as a journal's settings record holds them: every setting as `/set` takes it,
    then the eviction."""
    return {**dict(state.settings.as_pairs()), "eviction": state.eviction}


def save_session(path: Path, state: ConversationState, model: str | None) -> None:
    """Write `state` as a JSON document (version 1), less a last message still waiting for its reply."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "streamchat": __version__,
        "model": model,
        "system_prompt": state.system_prompt,
        "eviction": state.eviction,
        "settings": dict(state.settings.as_pairs()),
        "messages": state.answered,
    }
    if state.tools is not None:
        document["tools"] = state.tools
    if state.answered_recalled:
        document["recalled"] = [_note_record(index, note) for index, note in sorted(state.answered_recalled.items())]
    path = path.expanduser()
    text = json.dumps(document, ensure_ascii=False, indent=2) + "\n"
    try:
        write_durably(path, lambda temporary: temporary.write_text(text, encoding="utf-8"))
    except OSError as error:
        raise SessionFileError(f"cannot save the session to {path}: {error.strerror or error}") from error


def read_session(path: Path) -> SavedSession:
    """A saved session in either format; SessionFileError says what is wrong with the file."""
    path = path.expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise SessionFileError(f"no saved session at {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SessionFileError(f"cannot read {path}: {error}") from error
    header = _journal_header(text)
    if header is not None:
        return _read_journal(path, header, text)
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise SessionFileError(f"{path} is not a saved session (invalid JSON at line {error.lineno})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not a streamchat session file")
    if document.get("version") != VERSION:
        raise SessionFileError(f"{path} has session format version {document.get('version')!r}; expected {VERSION}")
    return SavedSession(
        messages=(messages := _messages(path, document.get("messages"))),
        system_prompt=_optional_text(path, document, "system_prompt"),
        settings=_settings(path, document.get("settings", {})),
        eviction=str(document.get("eviction", "token")),
        model=_optional_text(path, document, "model"),
        recalled=_notes(path, document.get("recalled", []), len(messages)),
        tools=_tools(str(path), document.get("tools")),
    )


def _note_record(index: int, note: RecalledNote) -> dict[str, Any]:
    return {"message": index, "from": list(note.messages), "content": note.text}


def _note(where: str, record: Any, count: int) -> tuple[int, RecalledNote]:
    """A recall note read back, for one of the `count` messages read before it: the user message it goes with,
    and the note; SessionFileError when malformed."""
    index, sources, text = (record.get(key) for key in ("message", "from", "content"))
    if (
        not isinstance(index, int)
        or not 0 <= index < count
        or index % 2  # the messages alternate from the user's: a user message's index is even
        or not isinstance(sources, list)
        or not all(isinstance(source, int) and 0 <= source < index for source in sources)
        or not isinstance(text, str)
    ):
        raise SessionFileError(f"{where}: a recall note needs a user message, the messages it is from, and text")
    return index, RecalledNote(tuple(sources), text)


def _notes(path: Path, value: Any, count: int) -> dict[int, RecalledNote]:
    if not isinstance(value, list) or not all(isinstance(record, dict) for record in value):
        raise SessionFileError(f"{path}: 'recalled' must be a list of notes")
    return dict(_note(str(path), record, count) for record in value)


def _messages(path: Path, value: Any) -> list[Message]:
    if not isinstance(value, list):
        raise SessionFileError(f"{path}: 'messages' must be a list")
    messages: list[Message] = []
    for number, message in enumerate(value, start=1):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ("user", "assistant", "tool")
            or not isinstance(message.get("content"), str)
        ):
            raise SessionFileError(f"{path}: message {number} needs a role (user or assistant) and text content")
        expected = "user" if number % 2 else "assistant"
        called = bool(messages and messages[-1].get("tool_calls"))
        if message["role"] == "tool" and not called:
            raise SessionFileError(f"{path}: message {number} holds tool results, but no reply called tools before it")
        if message["role"] not in (expected, "tool" if called else expected):
            raise SessionFileError(
                f"{path}: message {number} is from the {message['role']}, expected the {expected} "
                "(a saved conversation alternates user and assistant, starting with the user)"
            )
        where = f"{path}: message {number}"
        if message["role"] == "tool":
            text = _user_text(where, message.get("user_text"))
            messages.append(tool_results_message(_tool_results(where, message.get("tool_results")), text))
        elif message["role"] == "assistant" and "tool_calls" in message:
            calls = _tool_calls(where, message["tool_calls"])
            messages.append({"role": "assistant", "content": message["content"], "tool_calls": calls})
        else:
            messages.append({"role": message["role"], "content": message["content"]})
    if len(messages) % 2:
        raise SessionFileError(f"{path}: the last message, {len(messages)}, has no reply")
    return messages


def _tools(where: str, value: Any) -> list[dict[str, Any]] | None:
    if value is not None and (not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value)):
        raise SessionFileError(f"{where}: 'tools' must be a list of function specs")
    return value or None


def _tool_calls(where: str, value: Any) -> list[ToolCall]:
    """A reply's tool calls read back (OpenAI's shape); SessionFileError when malformed."""
    calls: list[ToolCall] = []
    for call in value if isinstance(value, list) else [None]:
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(call, dict)
            or not isinstance(call.get("id"), str)
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not isinstance(function.get("arguments"), str)
        ):
            raise SessionFileError(f"{where}: each tool call needs an id, and a function's name and arguments")
        calls.append({"id": call["id"], "type": "function", "function": {**function}})  # type: ignore[typeddict-item]
    return calls


def _tool_results(where: str, value: Any) -> list[ToolResult]:
    """Tool results read back; SessionFileError when malformed."""
    if not isinstance(value, list) or not all(
        isinstance(result, dict)
        and isinstance(result.get("tool_call_id"), str)
        and isinstance(result.get("content"), str)
        for result in value
    ):
        raise SessionFileError(f"{where}: tool results need each a tool_call_id and text content")
    return [{"tool_call_id": result["tool_call_id"], "content": result["content"]} for result in value]


def _user_text(where: str, value: Any) -> str:
    """The user's words sent with tool results ("" for none); SessionFileError when not text."""
    if value is not None and not isinstance(value, str):
        raise SessionFileError(f"{where}: the text after tool results must be text")
    return value or ""


def _settings(path: Path, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise SessionFileError(f"{path}: 'settings' must map names to text values")
    return dict(value)


def _optional_text(path: Path, document: dict[str, Any], key: str) -> str | None:
    value = document.get(key)
    if value is not None and not isinstance(value, str):
        raise SessionFileError(f"{path}: {key!r} must be text")
    return value


def saved_layout(path: Path) -> dict[str, str]:
    """The cache layout a journal's header records ("keep", "window"), as text; empty for a JSON session file
    (/save FILE), or for a file that cannot be read (read_session says why)."""
    try:
        with path.expanduser().open(encoding="utf-8") as file:
            header = _journal_header(file.readline())
    except (OSError, UnicodeDecodeError):
        return {}
    cache = header.get("cache") if header is not None else None
    if not isinstance(cache, dict):
        return {}
    # Journals written before --keep recorded it as "sinks", a number of first tokens.
    layout = {"keep": cache.get("keep", cache.get("sinks")), "window": cache.get("window")}
    return {name: str(value) for name, value in layout.items() if type(value) in (str, int)}


def _journal_header(text: str) -> dict[str, Any] | None:
    """The header of a journal, None when `text` is not one (a version 1 document starts with a lone brace)."""
    first_line = text.split("\n", 1)[0]
    try:
        header = json.loads(first_line)
    except json.JSONDecodeError:
        return None
    if isinstance(header, dict) and header.get("format") == FORMAT and header.get("version") == JOURNAL_VERSION:
        return header
    return None


def _read_journal(path: Path, header: dict[str, Any], text: str) -> SavedSession:
    """Replay a journal's records: the conversation and settings as they stood at its last complete line."""
    values: dict[str, str] = {}
    system_prompt = None
    tools: list[dict[str, Any]] | None = None
    messages: list[Message] = []
    recalled: dict[int, RecalledNote] = {}
    last_reply_stopped = False  # the last record that changed the messages added a stopped reply
    lines = text.split("\n")
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):  # the last line, without its newline: a write cut short
                break
            raise SessionFileError(f"{path} line {number}: not a valid record (the file is damaged there)") from None
        if not isinstance(record, dict):
            raise SessionFileError(f"{path} line {number}: not a valid record (expected a JSON object)")
        kind = record.get("type")
        if kind == "settings":
            values |= _settings(path, record.get("values", {}))
        elif kind == "system":
            system_prompt = _optional_text(path, record, "content")
        elif kind == "tools":
            tools = _tools(f"{path} line {number}", record.get("tools"))
        elif kind in ("user", "tool"):
            if messages and is_prompt(messages[-1]):
                messages.pop()  # never answered, and followed by another: it left the conversation
                recalled.pop(len(messages), None)
            if kind == "user":
                messages.append({"role": "user", "content": _record_text(path, number, record)})
            elif messages and messages[-1].get("tool_calls"):
                where = f"{path} line {number}"
                text = _user_text(where, record.get("text"))
                messages.append(tool_results_message(_tool_results(where, record.get("results")), text))
            last_reply_stopped = False
        elif kind == "reply" and messages and is_prompt(messages[-1]):
            reply: Message = {"role": "assistant", "content": _record_text(path, number, record)}
            if "tool_calls" in record:
                reply["tool_calls"] = _tool_calls(f"{path} line {number}", record["tool_calls"])
            messages.append(reply)
            last_reply_stopped = record.get("stop_reason") == "interrupted"
        elif kind == "recall":
            index, note = _note(f"{path} line {number}", record, len(messages))
            recalled[index] = note
        elif kind == "rewind":
            kept = record.get("messages")
            if not isinstance(kept, int) or kept < 0:
                raise SessionFileError(f"{path} line {number}: a rewind needs a message count")
            del messages[kept:]
            recalled = {index: note for index, note in recalled.items() if index < kept}
            last_reply_stopped = False
    unanswered = messages.pop()["content"] if messages and messages[-1]["role"] == "user" else None
    if messages and messages[-1]["role"] == "tool":  # tool results never answered: the client sends them again
        messages.pop()
    recalled = {index: note for index, note in recalled.items() if index < len(messages)}
    return SavedSession(
        messages=messages,
        system_prompt=system_prompt,
        settings={key: value for key, value in values.items() if key != "eviction"},
        eviction=values.get("eviction", "token"),
        model=_optional_text(path, header, "model"),
        unanswered=unanswered,
        last_reply_stopped=last_reply_stopped,
        version=JOURNAL_VERSION,
        recalled=recalled,
        tools=tools,
    )


def _record_text(path: Path, number: int, record: dict[str, Any]) -> str:
    content = record.get("content")
    if not isinstance(content, str):
        raise SessionFileError(f"{path} line {number}: a {record.get('type')} record needs text content")
    return content


@dataclass(frozen=True)
class SessionSummary:
    """One saved session, for `streamchat sessions`."""

    path: Path
    updated: datetime  # the file's last change
    model: str | None
    turns: int  # the user's messages
    first_message: str | None


def list_sessions(directory: Path) -> tuple[list[SessionSummary], list[str]]:
    """The sessions saved in `directory`, newest first, and a one-line problem for each file that cannot be read."""
    summaries, problems = [], []
    paths = sorted(directory.glob("*.json*")) if directory.is_dir() else []
    for path in paths:
        if path.suffix not in (".json", ".jsonl") or not path.is_file():
            continue
        try:
            saved = read_session(path)
            updated = datetime.fromtimestamp(path.stat().st_mtime).astimezone()
        except (SessionFileError, OSError) as error:
            problems.append(str(error))
            continue
        users = [message["content"] for message in saved.messages if message["role"] == "user"]
        if saved.unanswered is not None:
            users.append(saved.unanswered)
        summaries.append(SessionSummary(path, updated, saved.model, len(users), users[0] if users else None))
    summaries.sort(key=lambda summary: summary.updated, reverse=True)
    return summaries, problems
