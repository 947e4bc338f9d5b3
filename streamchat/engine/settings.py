"""How replies are generated: a frozen, validated set of sampling settings.

Defaults come from the model's generation config where it sets a value, else from
streamchat.defaults. The chat's `/set KEY VALUE` command changes one setting from its
text through with_value(); as_pairs() lists every setting in that same text form.
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import GenerationConfig

from streamchat import defaults
from streamchat.errors import ConfigError

# Largest seed torch.Generator.manual_seed accepts.
MAX_SEED = 2**64 - 1
# How `/set seed` and `/set stop` spell "no value".
RANDOM_SEED = "random"
NO_STOP = "none"

# name -> (type, accepted values, how an error message states them)
_RULES: dict[str, tuple[type, Callable[[Any], bool], str]] = {
    "max_new_tokens": (int, lambda value: value >= 1, "a whole number of at least 1"),
    "temperature": (float, lambda value: value >= 0, "a number of at least 0 (0 = greedy)"),
    "top_p": (float, lambda value: 0 < value <= 1, "a number above 0 and at most 1 (1 = off)"),
    "top_k": (int, lambda value: value >= 0, "a whole number of at least 0 (0 = off)"),
    "min_p": (float, lambda value: 0 <= value <= 1, "a number from 0 to 1 (0 = off)"),
    "repetition_penalty": (float, lambda value: value > 0, "a number above 0 (1 = off)"),
    "seed": (
        int,
        lambda value: 0 <= value <= MAX_SEED,
        f"a whole number from 0 to {MAX_SEED}, or {RANDOM_SEED!r}",
    ),
}
_STOP_ALLOWED = f"words separated by spaces (quote one that holds a space), or {NO_STOP!r}"


@dataclass(frozen=True)
class GenerationSettings:
    """Sampling settings for a reply. Validated on creation: bad values raise ConfigError."""

    max_new_tokens: int = defaults.MAX_NEW_TOKENS
    temperature: float = defaults.TEMPERATURE
    top_p: float = defaults.TOP_P
    top_k: int = defaults.TOP_K
    min_p: float = defaults.MIN_P
    repetition_penalty: float = defaults.REPETITION_PENALTY
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # strings that end a reply where they appear

    def __post_init__(self) -> None:
        for name, (kind, accepts, allowed) in _RULES.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            if not _is_number(value, kind) or not accepts(value):
                raise ConfigError(f"{name} must be {allowed}, got {value!r}.")
            object.__setattr__(self, name, kind(value))  # a config's temperature 1 becomes 1.0
        if not isinstance(self.stop, tuple) or not all(isinstance(text, str) and text for text in self.stop):
            raise ConfigError(f"stop must be a tuple of non-empty strings, got {self.stop!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @classmethod
    def from_generation_config(cls, config: GenerationConfig | None) -> GenerationSettings:
        """streamchat's defaults, overridden by the values the model's generation config sets."""
        if config is None:
            return cls()
        # transformers 5 leaves unset fields as None, so a model that says nothing about
        # do_sample keeps sampling, and only an explicit do_sample=False means greedy.
        names = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        overrides = {name: getattr(config, name) for name in names if getattr(config, name, None) is not None}
        if config.do_sample is False:
            overrides["temperature"] = 0.0
        try:
            return cls(**overrides)
        except ConfigError as error:
            raise ConfigError(f"the model's generation config: {error}") from error

    def with_value(self, key: str, text: str) -> GenerationSettings:
        """A copy with one setting parsed from text, as typed after `/set KEY`."""
        if key not in _FIELD_NAMES:
            raise ConfigError(f"unknown setting {key!r}; settings: {', '.join(_FIELD_NAMES)}.")
        text = text.strip()
        if key == "stop":
            return dataclasses.replace(self, stop=_parse_stop(text))
        if key == "seed" and text.lower() == RANDOM_SEED:
            return dataclasses.replace(self, seed=None)
        kind, _, allowed = _RULES[key]
        try:
            value = kind(text)
        except ValueError:
            raise ConfigError(f"{key} must be {allowed}, got {text!r}.") from None
        return dataclasses.replace(self, **{key: value})

    def as_pairs(self) -> list[tuple[str, str]]:
        """(name, value) of every setting, each value in the form with_value() accepts."""
        return [(name, _format(getattr(self, name))) for name in _FIELD_NAMES]


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(GenerationSettings))


def _is_number(value: Any, kind: type) -> bool:
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, int)
    return isinstance(value, (int, float)) and math.isfinite(value)


def _parse_stop(text: str) -> tuple[str, ...]:
    if text.lower() in ("", NO_STOP):
        return ()
    try:
        return tuple(shlex.split(text))
    except ValueError:
        raise ConfigError(f"stop must be {_STOP_ALLOWED}, got {text!r}.") from None


def _format(value: Any) -> str:
    if value is None:
        return RANDOM_SEED
    if isinstance(value, tuple):
        return shlex.join(value) if value else NO_STOP
    return str(value)
