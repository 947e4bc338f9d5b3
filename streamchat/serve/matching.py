"""Which conversation a stateless request continues: an index from what a conversation says to its id.

A client resends the whole history each time. After each turn the server files the
conversation under a digest of (system prompt, tools, messages); a request whose history (all
but its new user message or tool results) has the same digest continues that conversation, and only
the new message is read. Messages are compared by content, as the server wrote them (a reply's tool
calls as the client was told them, their ids included; tool results by call id and text, and the
user's words sent with them): a client that edits an earlier turn, or trims a reply, starts a new
conversation. The one exception
is a reply cut short because its client left mid-stream: the server knows what it sent,
not what the client read, so a history ending on any start of that reply (or just before
it) continues it. A journal whose last reply was stopped is filed that way when the server
starts, as its client may have left.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from streamchat.conversation.message import Message

# The session ids the journal writes (streamchat.storage.journal.new_session_id): 20250101-120000-3fa2c1.
SESSION_ID = re.compile(r"\d{8}-\d{6}-[0-9a-f]{6}")


def is_session_id(text: str) -> bool:
    return SESSION_ID.fullmatch(text) is not None


Tools = list[dict[str, Any]] | None


def history_digest(system: str | None, messages: list[Message], tools: Tools = None) -> str:
    """What a conversation says: its system prompt, its tools, and every message, by role and content (and a
    reply's tool calls, tool results)."""
    said: list[object] = [system, [_said(message) for message in messages]]
    if tools:  # a conversation without tools has the digest it always had
        said.append(tools)
    return hashlib.sha256(json.dumps(said, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


def _said(message: Message) -> list[object]:
    said: list[object] = [message["role"], message["content"]]
    if "tool_calls" in message:
        said.append(message["tool_calls"])
    if "tool_results" in message:
        said.append(message["tool_results"])
    if "user_text" in message:  # only where there is some: results alone are matched as they always were
        said.append(message["user_text"])
    return said


class ConversationIndex:
    """Each conversation filed under the digest of what it says now (one digest per conversation)."""

    def __init__(self) -> None:
        self._by_digest: dict[str, str] = {}
        self._digest_of: dict[str, str] = {}
        # Conversations whose last reply was cut short, by the digest of what came before it: (id, reply sent).
        self._cut_by_digest: dict[str, tuple[str, str]] = {}
        self._cut_digest_of: dict[str, str] = {}

    def file(
        self,
        conversation: str,
        system: str | None,
        messages: list[Message],
        cut_short: bool = False,
        tools: Tools = None,
    ) -> None:
        """`conversation` now says `messages` with `tools`: requests that extend them continue it. `cut_short`: the
        last message is a reply whose client left mid-stream, having read any start of it."""
        self.forget(conversation)
        digest = history_digest(system, messages, tools)
        self._by_digest[digest] = conversation
        self._digest_of[conversation] = digest
        if cut_short and messages and messages[-1]["role"] == "assistant":
            before = history_digest(system, messages[:-1], tools)
            self._cut_by_digest[before] = (conversation, messages[-1]["content"])
            self._cut_digest_of[conversation] = before

    def find(self, system: str | None, history: list[Message], tools: Tools = None) -> str | None:
        """The conversation that says `history` under `system` and `tools` (or all but the end of its last reply,
        cut short: any start of it, none included), if any."""
        digest = history_digest(system, history, tools)
        found = self._by_digest.get(digest)
        if found is not None or not history:
            return found
        if history[-1]["role"] != "assistant":  # none of a reply cut short
            cut = self._cut_by_digest.get(digest)
            return None if cut is None else cut[0]
        cut = self._cut_by_digest.get(history_digest(system, history[:-1], tools))
        if cut is not None and cut[1].startswith(history[-1]["content"]):
            return cut[0]
        return None

    def forget(self, conversation: str) -> None:
        digest = self._digest_of.pop(conversation, None)
        if digest is not None and self._by_digest.get(digest) == conversation:
            del self._by_digest[digest]
        before = self._cut_digest_of.pop(conversation, None)
        if before is not None and self._cut_by_digest.get(before, ("",))[0] == conversation:
            del self._cut_by_digest[before]
