"""Option values from any source (a command-line value, an environment string, a TOML value), checked.

Each converter returns the option's value or raises ValueError saying, in a few words,
what is wrong; streamchat.interface.config adds where the value came from.
"""

from __future__ import annotations

import math
import shlex
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from streamchat.errors import ConfigError

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# Turns a raw value (a string from the environment, a TOML value, a typed CLI value)
# into the option's value; raises ValueError saying what is wrong with it.
Converter = Callable[[object], Any]


def integer(raw: object) -> int:
    if isinstance(raw, (int, str)) and not isinstance(raw, bool):  # True is an int to Python
        with suppress(ValueError):
            return int(raw)
    raise ValueError("not an integer")


def number(raw: object) -> float:
    if isinstance(raw, bool) or not isinstance(raw, (int, float, str)):
        raise ValueError("not a number")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def boolean(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return raw.strip().lower() in TRUE_WORDS
    raise ValueError(f"not a boolean (use {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")


def text(raw: object) -> str:
    if isinstance(raw, str):
        return raw
    raise ValueError("not a string")


def one_of(choices: tuple[str, ...]) -> Converter:
    def convert(raw: object) -> str:
        value = text(raw)
        if value in choices:
            return value
        raise ValueError(f"must be one of {', '.join(choices)}")

    return convert


def stop_strings(raw: object) -> tuple[str, ...]:
    # The environment gives one string, read as shell words like `/set stop`; the command
    # line and TOML give a list.
    strings = shlex.split(raw) if isinstance(raw, str) else raw
    if isinstance(strings, (list, tuple)) and all(isinstance(text, str) and text for text in strings):
        return tuple(strings)
    raise ValueError("must be non-empty strings")


def checked(convert: Converter, holds: Callable[[Any], bool], rule: str) -> Converter:
    def convert_and_check(raw: object) -> Any:
        value = convert(raw)
        if not holds(value):
            raise ValueError(rule)
        return value

    return convert_and_check


def checked_by(check: Callable[[Any], Any], rule: str) -> Converter:
    """An option the engine checks itself (raising ConfigError): its check, and the rule in these words.

    The check is given the raw value as it came (text, or a config file's value of any type) and refuses
    what it does not name."""

    def convert(raw: object) -> Any:
        try:
            return check(raw)
        except ConfigError:
            raise ValueError(f"must be {rule}") from None

    return convert


def word_or_number(word: str, least: int, rule: str) -> Converter:
    """`word`, or a whole number of at least `least` (--keep system|N, --tp auto|N)."""

    def convert(raw: object) -> str | int:
        if raw == word:
            return word
        with suppress(ValueError):
            if (number := integer(raw)) >= least:
                return number
        raise ValueError(rule)

    return convert
