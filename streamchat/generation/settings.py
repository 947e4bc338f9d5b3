"""How replies are generated: a frozen, validated set of sampling settings, and changes to it.

Defaults come from the model's generation config where it sets a value, else from
streamchat.defaults. Each edge builds a typed `GenerationChanges` once (a request's JSON
fields, a command line's options), or parses one from text where text is what it gets
(`/set KEY VALUE`: parse_setting()); `settings.changed(changes)` applies it, validated.
as_pairs() lists every setting as text, in the form parse_setting() reads (what /set shows
and the session files hold).
"""

from __future__ import annotations

import dataclasses
import math
import shlex
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict, cast

from streamchat import defaults
from streamchat.errors import ConfigError

if TYPE_CHECKING:
    from transformers import GenerationConfig

# Largest seed torch.Generator.manual_seed accepts.
MAX_SEED = 2**64 - 1
# How `/set seed` and `/set stop` spell "no value".
RANDOM_SEED = "random"
NO_STOP = "none"


@dataclass(frozen=True)
class Rule:
    """The values a numeric setting accepts, stated once for `/set`, the config file and the command line."""

    kind: type  # int or float
    minimum: int
    maximum: int | None = None
    above_minimum: bool = False  # the minimum itself is refused
    note: str = ""  # the value that turns the setting off, e.g. "0 = off"

    def accepts(self, value: float) -> bool:
        above = value > self.minimum if self.above_minimum else value >= self.minimum
        return above and (self.maximum is None or value <= self.maximum)

    @property
    def limits(self) -> str:
        """The bounds, tersely: ">= 0", "> 0 and <= 1", "between 0 and 1"."""
        if self.maximum is None:
            return f"{'>' if self.above_minimum else '>='} {self.minimum}"
        if self.above_minimum:
            return f"> {self.minimum} and <= {self.maximum}"
        return f"between {self.minimum} and {self.maximum}"

    @property
    def described(self) -> str:
        """The bounds in words, with what the setting's off value is: "a number of at least 0 (0 = greedy)"."""
        noun = "a whole number" if self.kind is int else "a number"
        if self.maximum is None:
            bounds = f"above {self.minimum}" if self.above_minimum else f"of at least {self.minimum}"
        elif self.above_minimum:
            bounds = f"above {self.minimum} and at most {self.maximum}"
        else:
            bounds = f"from {self.minimum} to {self.maximum}"
        return f"{noun} {bounds}" + (f" ({self.note})" if self.note else "")


SAMPLING_RULES = {
    "max_new_tokens": Rule(int, 1),
    "temperature": Rule(float, 0, note="0 = greedy"),
    "top_p": Rule(float, 0, 1, above_minimum=True, note="1 = off"),
    "top_k": Rule(int, 0, note="0 = off"),
    "min_p": Rule(float, 0, 1, note="0 = off"),
    "repetition_penalty": Rule(float, 0, above_minimum=True, note="1 = off"),
    # OpenAI's range; below 0 they favour repeating the reply's tokens.
    "frequency_penalty": Rule(float, -2, 2, note="0 = off"),
    "presence_penalty": Rule(float, -2, 2, note="0 = off"),
    "seed": Rule(int, 0, MAX_SEED),
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
    frequency_penalty: float = defaults.FREQUENCY_PENALTY
    presence_penalty: float = defaults.PRESENCE_PENALTY
    seed: int | None = None  # None: a fresh random seed
    stop: tuple[str, ...] = ()  # strings that end a reply where they appear

    def __post_init__(self) -> None:
        for name, rule in SAMPLING_RULES.items():
            value = getattr(self, name)
            if name == "seed" and value is None:
                continue
            if not _is_number(value, rule.kind) or not rule.accepts(value):
                raise ConfigError(f"{name} must be {_allowed(name)}, got {value!r}.")
            object.__setattr__(self, name, rule.kind(value))  # a config's temperature 1 becomes 1.0
        if not isinstance(self.stop, tuple) or not all(isinstance(text, str) and text for text in self.stop):
            raise ConfigError(f"stop must be a tuple of non-empty strings, got {self.stop!r}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def counts_reply_tokens(self) -> bool:
        """Whether a penalty counts the tokens drawn so far in the reply (the frequency or presence penalty is on)."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0

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

    def changed(self, changes: GenerationChanges) -> GenerationSettings:
        """A copy with `changes` made; ConfigError names the first value that is wrong."""
        return dataclasses.replace(self, **changes)

    def changes_to(self, other: GenerationSettings) -> GenerationChanges:
        """The settings `other` sets differently: `self.changed(self.changes_to(other)) == other`."""
        differing = {name: getattr(other, name) for name in _FIELD_NAMES if getattr(self, name) != getattr(other, name)}
        return cast(GenerationChanges, differing)  # the fields' names, with their values

    def as_pairs(self) -> list[tuple[str, str]]:
        """(name, value) of every setting, each value in the form parse_setting() reads."""
        return [(name, _format(getattr(self, name))) for name in _FIELD_NAMES]


class GenerationChanges(TypedDict, total=False):
    """Some of GenerationSettings' fields, typed: what one request, option or `/set` changes."""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int | None
    stop: tuple[str, ...]


_FIELD_NAMES = tuple(field.name for field in dataclasses.fields(GenerationSettings))


def parse_setting(key: str, text: str) -> GenerationChanges:
    """The change `/set KEY TEXT` asks for, typed (`temperature`, "0.5" -> {"temperature": 0.5}); ConfigError
    for an unknown key or a value the setting does not take."""
    if key not in _FIELD_NAMES:
        raise ConfigError(f"unknown setting {key!r}; settings: {', '.join(_FIELD_NAMES)}.")
    text = text.strip()
    if key == "stop":
        return GenerationChanges(stop=_parse_stop(text))
    if key == "seed" and text.lower() == RANDOM_SEED:
        return GenerationChanges(seed=None)
    try:
        value = SAMPLING_RULES[key].kind(text)
    except ValueError:
        raise ConfigError(f"{key} must be {_allowed(key)}, got {text!r}.") from None
    GenerationSettings(**{key: value})  # refused as it is parsed (-1 is a number, not a temperature)
    return cast(GenerationChanges, {key: value})  # key is one of the fields, value of its kind


def _allowed(name: str) -> str:
    described = SAMPLING_RULES[name].described
    return f"{described}, or {RANDOM_SEED!r}" if name == "seed" else described


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
