from __future__ import annotations

from pathlib import Path

import pytest

from streamchat.app.slash_commands import (
    COMMANDS,
    CacheInfo,
    ChatText,
    Help,
    Load,
    Quit,
    Regen,
    Reset,
    Save,
    Set,
    Stats,
    System,
    complete,
    parse_line,
)
from streamchat.errors import CommandError


@pytest.mark.parametrize(
    ("line", "command"),
    [
        ("/help", Help()),
        ("/reset", Reset()),
        ("/regen", Regen()),
        ("/stats", Stats()),
        ("/cache", CacheInfo()),
        ("/quit", Quit()),
        ("/exit", Quit()),
        ("  /HELP  ", Help()),
        ("/system", System()),
        ("/system   You are a pirate.  Talk like one. ", System("You are a pirate.  Talk like one.")),
        ("/set", Set()),
        ("/set temperature 0.2", Set("temperature", "0.2")),
        ("/set   stop_words  end of  text ", Set("stop_words", "end of  text")),
        ("/save", Save()),
        ("/save my chat.json", Save(Path("my chat.json"))),
        ("/save ~/chats/a.json", Save(Path.home() / "chats" / "a.json")),
        ("/load chat.json", Load(Path("chat.json"))),
    ],
)
def test_commands_parse_to_typed_values(line: str, command: object) -> None:
    assert parse_line(line) == command


@pytest.mark.parametrize(
    ("line", "text"),
    [
        ("Hello there", "Hello there"),
        ("  Hello there  ", "Hello there"),
        ("", ""),
        ("//etc/hosts is empty", "/etc/hosts is empty"),
        ("//help", "/help"),
        ("///", "//"),
        ("/ is the root directory", "/ is the root directory"),
        ("/", "/"),
        ("what does /help do?", "what does /help do?"),
    ],
)
def test_other_lines_are_messages_and_double_slash_escapes_one_slash(line: str, text: str) -> None:
    assert parse_line(line) == ChatText(text)


@pytest.mark.parametrize(
    ("line", "error"),
    [
        (
            "/hlep",
            "unknown command /hlep; did you mean /help? (start a message with // to send it as text)",
        ),
        (
            "/Sytem be nice",
            "unknown command /Sytem; did you mean /system? (start a message with // to send it as text)",
        ),
        (
            "/usr/bin/env is missing",
            "unknown command /usr/bin/env; type /help to list the commands "
            "(start a message with // to send it as text)",
        ),
        ("/load", "/load needs an argument; usage: /load FILE"),
        ("/set top_p", "/set top_p needs a value; usage: /set [KEY VALUE]"),
        ("/reset now", "/reset takes no argument; usage: /reset"),
        ("/exit please", "/exit takes no argument; usage: /quit"),
    ],
)
def test_bad_commands_say_what_to_type(line: str, error: str) -> None:
    with pytest.raises(CommandError) as raised:
        parse_line(line)
    assert str(raised.value) == error


def test_every_command_has_a_usage_and_a_one_line_summary() -> None:
    assert [spec.name for spec in COMMANDS] == [
        "help",
        "reset",
        "regen",
        "system",
        "set",
        "save",
        "load",
        "stats",
        "cache",
        "quit",
    ]
    for spec in COMMANDS:
        assert spec.usage.startswith(f"/{spec.name}")
        assert spec.summary and "\n" not in spec.summary


KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")


@pytest.mark.parametrize(
    ("text", "completions"),
    [
        ("/", [f"/{spec.name}" for spec in COMMANDS] + ["/exit"]),
        ("/s", ["/system", "/set", "/save", "/stats"]),
        ("/RE", ["/reset", "/regen"]),
        ("/e", ["/exit"]),
        ("/set ", list(KEYS)),
        ("/set top", ["top_p", "top_k"]),
        ("/set top_p 0", []),
        ("/save ", []),
        ("hello /s", []),
        ("//s", []),
        ("", []),
    ],
)
def test_completion_offers_commands_then_setting_keys(text: str, completions: list[str]) -> None:
    assert complete(text, KEYS) == completions
