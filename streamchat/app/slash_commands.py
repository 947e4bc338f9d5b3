"""Slash commands typed at the chat prompt: parsing, help texts and completion.

A line is a command when it starts with "/" directly followed by a name: "/help",
"/set top_p 0.9". Everything else is a message to the model, with one escape: a
leading "//" stands for a single "/", so "//etc/hosts is empty" sends "/etc/hosts is
empty". A "/" followed by a space, or alone, is sent as typed.

Command names are case-insensitive; the argument is the rest of the line, spaces and all.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from streamchat.errors import CommandError


@dataclass(frozen=True)
class Help:
    pass


@dataclass(frozen=True)
class Reset:
    pass


@dataclass(frozen=True)
class Regen:
    pass


@dataclass(frozen=True)
class System:
    text: str = ""  # "": show the current system prompt


@dataclass(frozen=True)
class Set:
    # Both None: show the current settings. Keys are validated by the engine's settings.
    key: str | None = None
    value: str | None = None


@dataclass(frozen=True)
class Save:
    path: Path | None = None  # None: the caller's default session file


@dataclass(frozen=True)
class Load:
    path: Path


@dataclass(frozen=True)
class Stats:
    pass


@dataclass(frozen=True)
class CacheInfo:
    pass


@dataclass(frozen=True)
class Quit:
    pass


@dataclass(frozen=True)
class ChatText:
    """A line that is no command: text for the model (with the "//" escape undone); may be "" for an empty line."""

    text: str


Command = Help | Reset | Regen | System | Set | Save | Load | Stats | CacheInfo | Quit


@dataclass(frozen=True)
class CommandSpec:
    name: str
    usage: str
    summary: str  # one line, for /help and completion menus
    argument: Literal["none", "optional", "required"]
    build: Callable[[str], Command]  # from the argument, "" when absent


def _set_command(argument: str) -> Set:
    if not argument:
        return Set()
    key, *value = argument.split(maxsplit=1)
    if not value:
        raise CommandError(f"/set {key} needs a value; usage: {_SET_USAGE}")
    return Set(key, value[0])


def _save_command(argument: str) -> Save:
    return Save(Path(argument).expanduser() if argument else None)


def _load_command(argument: str) -> Load:
    return Load(Path(argument).expanduser())


_SET_USAGE = "/set [KEY VALUE]"

COMMANDS: tuple[CommandSpec, ...] = (
    CommandSpec("help", "/help", "show these commands", "none", lambda _: Help()),
    CommandSpec("reset", "/reset", "start a new conversation (empties the cache)", "none", lambda _: Reset()),
    CommandSpec("regen", "/regen", "answer the last message again", "none", lambda _: Regen()),
    CommandSpec("system", "/system [TEXT]", "set the system prompt, or show it", "optional", System),
    CommandSpec("set", _SET_USAGE, "change a setting, or show them all", "optional", _set_command),
    CommandSpec("save", "/save [FILE]", "say where it is saved, or save a copy as JSON", "optional", _save_command),
    CommandSpec("load", "/load FILE", "load a saved conversation", "required", _load_command),
    CommandSpec("stats", "/stats", "show speed and token counts", "none", lambda _: Stats()),
    CommandSpec("cache", "/cache", "show what the cache holds", "none", lambda _: CacheInfo()),
    CommandSpec("quit", "/quit", "leave streamchat (also /exit)", "none", lambda _: Quit()),
)
ALIASES = {"exit": "quit"}
_SPECS = {spec.name: spec for spec in COMMANDS}
_NAMES = (*_SPECS, *ALIASES)


def parse_line(line: str) -> Command | ChatText:
    """A command for a "/name ..." line, else the message to send; CommandError for a bad command."""
    text = line.strip()
    if text.startswith("//"):
        return ChatText(text[1:])
    if not text.startswith("/") or len(text) == 1 or text[1].isspace():
        return ChatText(text)
    word, *rest = text[1:].split(maxsplit=1)
    name = word.lower()
    spec = _SPECS.get(ALIASES.get(name, name))
    if spec is None:
        raise CommandError(_unknown_command_message(word))
    argument = rest[0] if rest else ""
    if argument and spec.argument == "none":
        raise CommandError(f"/{name} takes no argument; usage: {spec.usage}")
    if not argument and spec.argument == "required":
        raise CommandError(f"/{name} needs an argument; usage: {spec.usage}")
    return spec.build(argument)


def _unknown_command_message(word: str) -> str:
    close = difflib.get_close_matches(word.lower(), _NAMES, n=1)
    hint = f"did you mean /{close[0]}?" if close else "type /help to list the commands"
    return f"unknown command /{word}; {hint} (start a message with // to send it as text)"


def complete(text_before_cursor: str, setting_keys: Iterable[str] = ()) -> list[str]:
    """Completions for the word being typed: a command name after "/", a key after "/set ".

    Each completion replaces the text after the last space (prompt_toolkit's
    document.get_word_before_cursor(WORD=True)).
    """
    words = text_before_cursor.split(" ")
    if len(words) == 1 and words[0].startswith("/") and not words[0].startswith("//"):
        prefix = words[0][1:].lower()
        return [f"/{name}" for name in _NAMES if name.startswith(prefix)]
    if len(words) == 2 and words[0].lower() == "/set":
        return [key for key in setting_keys if key.startswith(words[1])]
    return []
