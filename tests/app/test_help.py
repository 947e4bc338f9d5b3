"""The help screens on an 80-column terminal: every option name whole, a value label in words, room for the help."""

import re

import pytest
import typer
from typer.testing import CliRunner

from streamchat.cli import app

COMMANDS = [
    (),
    ("models",),
    ("sessions",),
    ("info",),
    ("run",),
    ("serve",),
    ("bench",),
    *(("bench", name) for name in ("ppl", "speed", "keep", "recall", "display", "decode", "load", "serve")),
]
# Continuation lines of an option's help, in a panel: their indent is where the help column starts.
HELP_CONTINUED = re.compile(r"^│( {8,})\S")


def help_screen(path: tuple[str, ...], columns: int) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": str(columns)}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def option_names(path: tuple[str, ...]) -> list[str]:
    command = typer.main.get_command(app)
    for name in path:
        command = command.commands[name]
    return [name for param in command.params for name in (*param.opts, *param.secondary_opts)]


def narrowest_help_column(screen: str, columns: int) -> int:
    indents = [len(match.group(1)) + 1 for line in screen.splitlines() if (match := HELP_CONTINUED.match(line))]
    return columns - 1 - max(indents)


@pytest.mark.parametrize("path", COMMANDS, ids=lambda path: " ".join(path) or "streamchat")
def test_every_help_screen_fits_80_columns_with_names_whole_and_labels_in_words(path: tuple[str, ...]):
    screen = help_screen(path, 80)
    assert max(len(line) for line in screen.splitlines()) <= 80
    assert "…" not in screen  # nothing cut: no option name, no word of a help text
    for name in [*option_names(path), "--help"]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", screen), name
    assert re.findall(r"<[a-z][^>]*>", screen) == []  # no <str>, <int>, <bool>, <list[str]>, <path>
    assert narrowest_help_column(screen, 80) >= 25 if HELP_CONTINUED.search(screen) else True


@pytest.mark.parametrize("path", [("run",), ("serve",)], ids=lambda path: path[0])
def test_run_and_serve_label_values_in_upper_case_and_give_the_model_panel_room(path: tuple[str, ...]):
    screen = help_screen(path, 80)
    labels = {
        "--model": "MODEL",
        "--device": "DEVICE",
        "--dtype": "DTYPE",
        "--quantize": "SCHEME",
        "--keep,--sinks": "system|N",
        "--window": "N",
        "--recall": "MODE",
    }
    for name, label in labels.items():
        assert re.search(rf"^│ {re.escape(name)}(?: +-m)? +{re.escape(label)} +\S", screen, re.MULTILINE), name
    assert "│ --help          Show this message and exit." in screen  # a flag has no label
    model_panel = screen[screen.index("╭─ Model") : screen.index("╰", screen.index("╭─ Model"))]
    assert narrowest_help_column(model_panel, 80) >= 45
    if path == ("run",):
        assert re.search(r"^│ --stop +TEXT +End a reply", screen, re.MULTILINE)
        assert re.search(r"^│ --resume +FILE\|ID +Go on", screen, re.MULTILINE)
    else:
        assert re.search(r"^│ --cors +ORIGIN +Let browser pages", screen, re.MULTILINE)
        assert re.search(r"^│ --api-key +KEY +Every endpoint", screen, re.MULTILINE)
