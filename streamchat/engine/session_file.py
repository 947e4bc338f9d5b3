"""Saved sessions: the transcript and settings as JSON. Loading replays the transcript through the cache.

The cache itself is not saved: it is a function of the transcript (and far larger).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamchat import __version__
from streamchat.errors import SessionFileError

FORMAT = "streamchat-session"
VERSION = 1


@dataclass(frozen=True)
class SavedSession:
    messages: list[dict[str, str]]
    system_prompt: str | None
    settings: dict[str, str]  # name -> value as /set takes it
    eviction: str
    model: str | None


def save_session(path: Path, saved: SavedSession) -> None:
    """Write atomically: an existing file is replaced only by a complete new one."""
    document = {
        "format": FORMAT,
        "version": VERSION,
        "streamchat": __version__,
        "model": saved.model,
        "system_prompt": saved.system_prompt,
        "eviction": saved.eviction,
        "settings": saved.settings,
        "messages": saved.messages,
    }
    path = path.expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            json.dump(document, file, ensure_ascii=False, indent=2)
            file.write("\n")
        os.replace(temporary, path)
    except OSError as error:
        raise SessionFileError(f"cannot save the session to {path}: {error.strerror or error}") from error


def read_session(path: Path) -> SavedSession:
    path = path.expanduser()
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SessionFileError(f"no saved session at {path}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise SessionFileError(f"cannot read {path}: {error}") from error
    except json.JSONDecodeError as error:
        raise SessionFileError(f"{path} is not a saved session (invalid JSON at line {error.lineno})") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise SessionFileError(f"{path} is not a streamchat session file")
    if document.get("version") != VERSION:
        raise SessionFileError(f"{path} has session format version {document.get('version')!r}; expected {VERSION}")
    return SavedSession(
        messages=_messages(path, document.get("messages")),
        system_prompt=_optional_text(path, document, "system_prompt"),
        settings=_settings(path, document.get("settings", {})),
        eviction=str(document.get("eviction", "token")),
        model=_optional_text(path, document, "model"),
    )


def _messages(path: Path, value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list):
        raise SessionFileError(f"{path}: 'messages' must be a list")
    messages = []
    for number, message in enumerate(value, start=1):
        if (
            not isinstance(message, dict)
            or message.get("role") not in ("user", "assistant")
            or not isinstance(message.get("content"), str)
        ):
            raise SessionFileError(f"{path}: message {number} needs a role (user or assistant) and text content")
        expected = "user" if number % 2 else "assistant"
        if message["role"] != expected:
            raise SessionFileError(
                f"{path}: message {number} is from the {message['role']}, expected the {expected} "
                "(a saved conversation alternates user and assistant, starting with the user)"
            )
        messages.append({"role": message["role"], "content": message["content"]})
    if len(messages) % 2:
        raise SessionFileError(f"{path}: the last message, {len(messages)}, has no reply")
    return messages


def _settings(path: Path, value: Any) -> dict[str, str]:
    if not isinstance(value, dict) or not all(isinstance(item, str) for item in value.values()):
        raise SessionFileError(f"{path}: 'settings' must map names to text values")
    return dict(value)


def _optional_text(path: Path, document: dict[str, Any], key: str) -> str | None:
    value = document.get(key)
    if value is not None and not isinstance(value, str):
        raise SessionFileError(f"{path}: {key!r} must be text")
    return value
