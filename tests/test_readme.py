"""README.md's examples: every `streamchat ...` command names commands, options and aliases that exist."""

import functools
import re
import shlex
from pathlib import Path

import pytest
import typer

from streamchat.cli import app
from streamchat.errors import ModelNotFoundError
from streamchat.loading.aliases import ALIASES
from streamchat.loading.resolve import resolve_model

README = Path(__file__).resolve().parent.parent / "README.md"


@functools.cache
def streamchat_command() -> typer.core.TyperGroup:
    return typer.main.get_command(app)


def commands_in_readme() -> list[str]:
    """Every streamchat command line in the README's code blocks and inline code, without its shell around it."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    prose = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    lines = [line for block in blocks for line in block.replace("\\\n", " ").split("\n")]
    lines += [code.replace("\n", " ") for code in re.findall(r"`([^`]+)`", prose)]
    commands = []
    for line in lines:
        line = re.split(r"\s+#\s", line)[0]  # a comment
        # At the start, after a prompt, environment variables or `python -m` / `torchrun -m`.
        found = re.search(r"(?:^|\$ |-m |\w+=\S+ )streamchat ([a-z]+(?: .*)?)$", line.strip())
        if found:
            commands.append(re.split(r" [<>|] ", found.group(1))[0])  # redirections and pipes
    return commands


def test_the_readme_has_examples_to_check():
    assert len(commands_in_readme()) > 50


@pytest.mark.parametrize("line", commands_in_readme())
def test_every_readme_command_names_options_and_models_that_exist(line: str):
    words = shlex.split(line)
    command = streamchat_command()
    while words and getattr(command, "commands", None) and words[0] in command.commands:
        command = command.commands[words.pop(0)]
    assert not getattr(command, "commands", None) or not words, f"no such command: {line}"
    params = {name: param for param in command.params for name in (*param.opts, *param.secondary_opts)}
    for index, word in enumerate(words):
        if not word.startswith("-") or word == "-" or words[index - 1] in ("--from", "--stop", "--system"):
            continue
        name = word.split("=")[0]
        assert name in params or name == "--help", f"{name} is no option of that command: {line}"
        value = words[index + 1] if index + 1 < len(words) else None
        if name in ("--model", "-m") and value is not None and value.islower() and "/" not in value:
            try:
                resolve_model(value)
            except ModelNotFoundError as error:
                assert "unknown model alias" not in str(error), line


def test_the_readme_alias_table_lists_every_alias():
    text = README.read_text(encoding="utf-8")
    table = text[text.index("| alias | hub id |") :].split("\n\n")[0]
    listed = {alias for row in table.splitlines()[2:] for alias in re.findall(r"`([^`]+)`", row.split("|")[1])}
    assert listed == set(ALIASES)
