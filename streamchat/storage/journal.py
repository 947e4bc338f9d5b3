"""The journal: one session file per conversation, appended as the conversation goes.

    sessions/20250101-120000-3fa2c1.jsonl
    {"format": "streamchat-session", "version": 2, "id": "20250101-120000-3fa2c1", "streamchat": "0.1.0",
     "model": "smollm2-135m", "created": "2025-01-01T12:00:00+00:00", "cache": {"sinks": 4, "window": 2000}}
    {"type": "settings", "values": {"temperature": "0.7", ..., "eviction": "token"}, "at": "..."}
    {"type": "system", "content": "Be brief.", "at": "..."}
    {"type": "tools", "tools": [{"type": "function", "function": {...}}], "at": "..."}   (a server's conversation)
    {"type": "user", "content": "Hello!", "at": "..."}
    {"type": "recall", "message": 6, "from": [0, 2], "content": "Earlier in this conversation: ...", "at": "..."}
                                                          (the note recall read before message 6)
    {"type": "reply", "content": "Hi.", "stop_reason": "eos", "at": "..."}
    {"type": "reply", "content": "", "tool_calls": [{"id": "call_1f..", "type": "function", "function": {...}}], ...}
    {"type": "tool", "results": [{"tool_call_id": "call_1f..", "content": "sunny"}], "at": "..."}
    {"type": "tool", "results": [...], "text": "Now book it.", "at": "..."}   (the user's words sent with the results)
    {"type": "rewind", "messages": 1, "at": "..."}        (a /regen took the reply back)

The records of each change are one write of whole lines to a file opened for appending,
followed by one fsync: a kill at any moment leaves every earlier record intact, and at
worst a last line cut short, which reading ignores (streamchat.storage.session_file reads journals).
So a crash loses at most the reply being generated. The file appears with the first
message; settings and system prompt changes made before it go into its first records.

The journal follows a conversation's values: `record(session.snapshot(tensors=False))`
appends whatever changed since the last call (new messages, a conversation that went
back, settings, the system prompt), so it follows every way the engine changes a
conversation without the engine knowing, and without knowing the engine.
A file being written is locked, so that two streamchats never append to the same one.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from streamchat import __version__
from streamchat.conversation.message import Message
from streamchat.conversation.state import ConversationState, RecalledNote
from streamchat.conversation.template import common_prefix_length
from streamchat.errors import SessionFileError
from streamchat.generation.events import StopReason
from streamchat.storage.durable import sync_directory
from streamchat.storage.session_file import FORMAT, JOURNAL_VERSION, SavedSession, settings_text

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; a second writer is not detected
    fcntl = None  # type: ignore[assignment]

SUFFIX = ".jsonl"


def new_session_id() -> str:
    """Sortable by creation time, unique without coordination: 20250101-120000-3fa2c1."""
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


class Journal:
    """The session file of the current conversation, in `directory`, for the model called `model`."""

    def __init__(
        self, directory: Path, model: str | None, cache: dict[str, str | int], on_error: Callable[[str], None]
    ) -> None:
        self.directory = directory
        self.model = model
        self.cache = cache
        self.on_error = on_error  # told once, when writing fails; the chat goes on unrecorded
        self.path: Path | None = None  # None until the conversation has a message
        self.failure: str | None = None
        self._descriptor: int | None = None
        self._messages: list[Message] = []  # the conversation as the file tells it
        self._settings: dict[str, str] = {}  # the settings as the file holds them: text, as /set takes it
        self._system: str | None = None
        self._tools: list[dict[str, Any]] | None = None
        self._recalled: dict[int, RecalledNote] = {}
        self._pending: list[dict[str, Any]] = []  # records of the change being written

    # ---- following the session ---------------------------------------------------------------

    def record(self, state: ConversationState, stop_reason: StopReason | None = None) -> None:
        """Append what changed in the conversation since the last call; `stop_reason` goes with a new last reply."""
        self._record(state, state.messages, stop_reason)

    def record_user(self, state: ConversationState, text: str) -> None:
        """The user sent `text` to the conversation `state`: written before the reply starts, so that a crash
        cannot lose it."""
        self.record_prompt(state, {"role": "user", "content": text})

    def record_prompt(self, state: ConversationState, message: Message) -> None:
        """A prompt turn (a user message, tool results) was sent to the conversation `state`, as record_user."""
        self._record(state, [*state.messages, message], None)

    def new_conversation(self) -> None:
        """The next message starts a new file (/reset)."""
        self.close()
        self.path, self.failure, self._messages, self._recalled = None, None, [], {}

    def resume(self, path: Path, saved: SavedSession, descriptor: int | None = None) -> None:
        """Append to the journal at `path` from now on: the conversation `saved` was read from it.

        `descriptor` is what claim_journal(path) returned, else it is claimed here: SessionFileError when
        another streamchat holds the file, and then nothing changes.
        """
        descriptor = claim_journal(path) if descriptor is None else descriptor
        self.close()
        self.path, self.failure, self._descriptor = path, None, descriptor
        unanswered: list[Message] = (
            [{"role": "user", "content": saved.unanswered}] if saved.unanswered is not None else []
        )
        self._messages = [*saved.messages, *unanswered]
        self._settings = {**saved.settings, "eviction": saved.eviction}
        self._system = saved.system_prompt
        self._tools = saved.tools
        self._recalled = dict(saved.recalled)

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)  # also releases the lock
            self._descriptor = None

    # ---- writing -------------------------------------------------------------------------------

    def _record(self, state: ConversationState, messages: list[Message], stop_reason: str | None) -> None:
        settings, system, recalled = settings_text(state), state.system_prompt, state.recalled
        if self.failure is not None:
            return
        if self.path is None and not messages:
            return  # no file before the first message
        try:
            if self._descriptor is None and self.path is None:
                self._create(settings, system, state.tools)
            changed = {key: value for key, value in settings.items() if self._settings.get(key) != value}
            if changed:
                self._append({"type": "settings", "values": changed})
                self._settings |= changed
            if system != self._system:
                self._append({"type": "system", "content": system})
                self._system = system
            if state.tools != self._tools:
                self._append({"type": "tools", "tools": state.tools})
                self._tools = state.tools
            self._append_messages(messages, stop_reason, recalled)
            self._write_pending()
        except (OSError, SessionFileError) as error:
            self._pending = []
            reason = str(error) if isinstance(error, SessionFileError) else error.strerror or str(error)
            where = self.path if self.path is not None else f"in {self.directory}"  # no name before it is created
            self.failure = f"cannot write the session file {where}: {reason}; the conversation is not being saved"
            self.close()
            self.on_error(self.failure)

    def _append_messages(
        self, messages: list[Message], stop_reason: str | None, recalled: dict[int, RecalledNote]
    ) -> None:
        kept = common_prefix_length(self._messages, messages)
        if kept < len(self._messages):
            self._append({"type": "rewind", "messages": kept})
            del self._messages[kept:]
            self._recalled = {index: note for index, note in self._recalled.items() if index < kept}
        for index in sorted(recalled):  # a note to a message written before this call
            if index < kept and self._recalled.get(index) != recalled[index]:
                self._append_recall(index, recalled[index])
        for index, message in enumerate(messages[kept:], start=kept):
            if message["role"] == "user":
                self._append({"type": "user", "content": message["content"]})
                if index in recalled:
                    self._append_recall(index, recalled[index])
            elif message["role"] == "tool":
                tool_record: dict[str, Any] = {"type": "tool", "results": message.get("tool_results", [])}
                if message.get("user_text"):  # the user's words sent with the results: the same turn
                    tool_record["text"] = message["user_text"]
                self._append(tool_record)
            else:
                record: dict[str, Any] = {"type": "reply", "content": message["content"]}
                if "tool_calls" in message:
                    record["tool_calls"] = message["tool_calls"]
                if stop_reason is not None and index == len(messages) - 1:
                    record["stop_reason"] = stop_reason
                self._append(record)
            self._messages.append(message.copy())

    def _append_recall(self, index: int, note: RecalledNote) -> None:
        self._append({"type": "recall", "message": index, "from": list(note.messages), "content": note.text})
        self._recalled[index] = note

    def _create(self, settings: dict[str, str], system: str | None, tools: list[dict[str, Any]] | None) -> None:
        session_id = new_session_id()
        self.directory.mkdir(parents=True, exist_ok=True)
        self.path = self.directory / f"{session_id}{SUFFIX}"
        header = {
            "format": FORMAT,
            "version": JOURNAL_VERSION,
            "id": session_id,
            "streamchat": __version__,
            "model": self.model,
            "created": _now(),
            "cache": self.cache,
        }
        self._descriptor = _open_for_appending(self.path, create=True)
        _write_lines(self._descriptor, [header])  # alone: the file never holds a header cut short
        sync_directory(self.directory)  # the file's name, too, survives a power cut
        self._settings, self._system, self._messages, self._recalled = {}, None, [], {}
        self._append({"type": "settings", "values": settings})
        self._settings = dict(settings)
        if system is not None:
            self._append({"type": "system", "content": system})
            self._system = system
        self._tools = tools
        if tools is not None:
            self._append({"type": "tools", "tools": tools})

    def _append(self, record: dict[str, Any]) -> None:
        self._pending.append({**record, "at": _now()})

    def _write_pending(self) -> None:
        """The records of one change, in one write and one fsync (a server's worker waits for each fsync)."""
        if not self._pending:
            return
        if self._descriptor is None:
            raise OSError("the session file is closed")
        records, self._pending = self._pending, []
        _write_lines(self._descriptor, records)


def claim_journal(path: Path) -> int:
    """The journal at `path`, opened for appending and locked, to resume (release_journal() gives it back).

    SessionFileError when it cannot be written, or another streamchat is writing it.
    """
    return _open_for_appending(path)


def release_journal(descriptor: int) -> None:
    """Give back a claimed journal that is not resumed after all."""
    os.close(descriptor)


def _open_for_appending(path: Path, create: bool = False) -> int:
    """A descriptor that appends to `path`, locked; a last line left torn by a kill is cut off first."""
    flags = os.O_WRONLY | os.O_APPEND | (os.O_CREAT | os.O_EXCL if create else 0)
    try:
        descriptor = os.open(path, flags, 0o600)  # conversations are private
    except OSError as error:
        raise SessionFileError(f"cannot write {path}: {error.strerror or error}") from error
    if fcntl is not None:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(descriptor)
            raise SessionFileError(
                f"{path} is being written by another streamchat; /load it there, or load a copy"
            ) from None
    if not create:
        _cut_torn_line(path, descriptor)
    return descriptor


def _cut_torn_line(path: Path, descriptor: int) -> None:
    """Appending after a line a kill cut short would glue the next record to it."""
    with path.open("rb") as file:
        if file.seek(0, os.SEEK_END) == 0:
            return
        file.seek(-1, os.SEEK_END)
        if file.read(1) == b"\n":
            return
        data = path.read_bytes()
    os.ftruncate(descriptor, data.rfind(b"\n") + 1)


def _write_lines(descriptor: int, records: list[dict[str, Any]]) -> None:
    data = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records).encode("utf-8")
    while data:
        written = os.write(descriptor, data)
        data = data[written:]
    os.fsync(descriptor)


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
