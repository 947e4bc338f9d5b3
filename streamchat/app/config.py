"""The configuration of `streamchat run`: command line > environment > config file > defaults.

Every option can be given three ways:

- on the command line: --max-new-tokens 256
- in the environment: STREAMCHAT_MAX_NEW_TOKENS=256 (an empty variable counts as unset;
  booleans are 1/0, true/false, yes/no, on/off)
- in the TOML config file, as top-level keys with dashes or underscores:
  max_new_tokens = 256. The file is $STREAMCHAT_CONFIG, else config.toml in the user
  config directory (see `config_file_location`); only the latter may be missing.

Each value is checked where it is read, so a bad one is reported with its source even
when a higher-precedence source overrides it. Sampling options left unset stay None:
the engine then uses the model's generation config.
"""

from __future__ import annotations

import difflib
import keyword
import math
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import platformdirs

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.loading.device import DEVICE_NAMES, DTYPE_NAMES, is_device_name, is_dtype_name
from streamchat.loading.quantization import QUANTIZE_NAMES, is_quantize_name
from streamchat.terminal.transcript import (
    OUTPUT_FORMATS,
    TRANSCRIPT_FORMATS,
    TURN_SPLITS,
    OutputFormat,
    TranscriptFormat,
    TurnSplit,
)

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

CONFIG_FILE_NAME = "config.toml"
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")

# Turns a raw value (a string from the environment, a TOML value, a typed CLI value)
# into the option's value; raises ValueError saying what is wrong with it.
Converter = Callable[[object], Any]


def _integer(raw: object) -> int:
    if isinstance(raw, int) and not isinstance(raw, bool):  # True is an int to Python
        return raw
    if isinstance(raw, str):
        try:
            return int(raw)
        except ValueError:
            pass
    raise ValueError("not an integer")


def _number(raw: object) -> float:
    if isinstance(raw, (int, float)) and not isinstance(raw, bool):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw)
        except ValueError:
            raise ValueError("not a number") from None
    else:
        raise ValueError("not a number")
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


def _boolean(raw: object) -> bool:
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in TRUE_WORDS + FALSE_WORDS:
        return raw.strip().lower() in TRUE_WORDS
    raise ValueError(f"not a boolean (use {'/'.join(TRUE_WORDS)} or {'/'.join(FALSE_WORDS)})")


def _text(raw: object) -> str:
    if isinstance(raw, str):
        return raw
    raise ValueError("not a string")


def _one_of(choices: tuple[str, ...]) -> Converter:
    def convert(raw: object) -> str:
        value = _text(raw)
        if value in choices:
            return value
        raise ValueError(f"must be one of {', '.join(choices)}")

    return convert


def _stop_strings(raw: object) -> tuple[str, ...]:
    # The environment gives one string, read as shell words like `/set stop`; the command
    # line and TOML give a list.
    strings = shlex.split(raw) if isinstance(raw, str) else raw
    if isinstance(strings, (list, tuple)) and all(isinstance(text, str) and text for text in strings):
        return tuple(strings)
    raise ValueError("must be non-empty strings")


def _checked(convert: Converter, holds: Callable[[Any], bool], rule: str) -> Converter:
    def convert_and_check(raw: object) -> Any:
        value = convert(raw)
        if not holds(value):
            raise ValueError(rule)
        return value

    return convert_and_check


@dataclass(frozen=True)
class RunConfig:
    """Everything `streamchat run` needs to know, validated (see _CONVERTERS for the rules)."""

    model: str = defaults.DEFAULT_MODEL
    keep: str | int = defaults.KEEP  # "system", or a number of first tokens
    window: int = defaults.WINDOW
    max_new_tokens: int | None = None  # None: the model's generation config, else defaults.MAX_NEW_TOKENS
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    system: str | None = None
    device: str = defaults.DEVICE
    dtype: str = defaults.DTYPE
    quantize: str = defaults.QUANTIZE
    device_map: str | None = None
    evict: str = defaults.EVICTION_POLICY
    read_all: bool = defaults.READ_ALL
    compile: str = defaults.COMPILE
    trust_remote_code: bool = False
    allow_pickle: bool = False
    markdown: bool = False
    transcript: str | None = None
    transcript_format: TranscriptFormat = defaults.TRANSCRIPT_FORMAT
    turns: TurnSplit = defaults.TRANSCRIPT_TURNS
    output_format: OutputFormat = defaults.OUTPUT_FORMAT
    continue_: bool = False  # the option `continue` (a Python keyword): go on with the most recent session
    resume: str | None = None  # a session file or id to go on with
    # Tensor parallelism: N ranks (this command starts them), "auto" (join torchrun's), None or 1: one process.
    tp: int | str | None = None

    def __post_init__(self) -> None:
        # Direct construction (tests, other commands) gets the same checks as resolve_run_config.
        for option in fields(self):
            value = getattr(self, option.name)
            if value is not None or option.default is not None:
                name = _option_name(option.name)
                _convert(name, value, f"{name}={value!r}")


def _keep(raw: object) -> str | int:
    if raw == defaults.KEEP_SYSTEM:
        return defaults.KEEP_SYSTEM
    try:
        number = _integer(raw)
    except ValueError:
        number = -1
    if number < 0:
        raise ValueError(f"must be {defaults.KEEP_SYSTEM!r} (the system turn) or a whole number of first tokens >= 0")
    return number


def _tp(raw: object) -> int | str:
    if raw == defaults.TP_AUTO:
        return defaults.TP_AUTO
    try:
        number = _integer(raw)
    except ValueError:
        number = 0
    if number < 1:
        raise ValueError(f"must be a number of ranks >= 1, or {defaults.TP_AUTO!r} (as many as torchrun started)")
    return number


_NON_NEGATIVE_INTEGER = _checked(_integer, lambda n: n >= 0, "must be >= 0")
_POSITIVE_INTEGER = _checked(_integer, lambda n: n >= 1, "must be >= 1")

# How each option is read and checked; its keys are the config-file keys.
_CONVERTERS: dict[str, Converter] = {
    "model": _checked(_text, bool, "must not be empty"),
    "keep": _keep,
    "window": _POSITIVE_INTEGER,
    "max_new_tokens": _POSITIVE_INTEGER,
    "temperature": _checked(_number, lambda x: x >= 0, "must be >= 0"),
    "top_p": _checked(_number, lambda x: 0 < x <= 1, "must be > 0 and <= 1"),
    "top_k": _NON_NEGATIVE_INTEGER,
    "min_p": _checked(_number, lambda x: 0 <= x <= 1, "must be between 0 and 1"),
    "repetition_penalty": _checked(_number, lambda x: x > 0, "must be > 0"),
    "seed": _NON_NEGATIVE_INTEGER,
    "stop": _stop_strings,
    "system": _text,
    # Which machine has the device is checked at load time (loading/device.py), not here.
    "device": _checked(_text, is_device_name, f"must be one of {DEVICE_NAMES}"),
    "dtype": _checked(_text, is_dtype_name, f"must be one of {DTYPE_NAMES}"),
    # Which device takes which quantization is checked at load time (loading/quantization.py).
    "quantize": _checked(_text, is_quantize_name, f"must be one of {QUANTIZE_NAMES}"),
    "device_map": _text,
    "evict": _one_of(defaults.EVICTION_POLICIES),
    "read_all": _boolean,
    "compile": _one_of(defaults.COMPILE_SETTINGS),
    "trust_remote_code": _boolean,
    "allow_pickle": _boolean,
    "markdown": _boolean,
    "transcript": _text,
    "transcript_format": _one_of(TRANSCRIPT_FORMATS),
    "turns": _one_of(TURN_SPLITS),
    "output_format": _one_of(OUTPUT_FORMATS),
    "continue": _boolean,
    "resume": _checked(_text, bool, "must not be empty"),
    "tp": _tp,
}


def _option_name(name: str) -> str:
    """The option a RunConfig field, a config key or a command-line parameter names: `continue_` is `continue`."""
    return name.replace("-", "_").rstrip("_")


def _field_name(option: str) -> str:
    return f"{option}_" if keyword.iskeyword(option) else option


def config_file_location(env: Mapping[str, str]) -> Path:
    """Where the config file is looked for: $STREAMCHAT_CONFIG, else config.toml in the user config dir."""
    named = env.get(defaults.CONFIG_FILE_ENV)
    if named:
        return Path(named).expanduser()
    # appauthor=False: on Windows, %LOCALAPPDATA%\streamchat without a vendor folder above it.
    return Path(platformdirs.user_config_dir(defaults.APP_NAME, appauthor=False)) / CONFIG_FILE_NAME


def find_config_file(env: Mapping[str, str]) -> Path | None:
    """The config file to read, None when there is none; a missing $STREAMCHAT_CONFIG file is an error."""
    path = config_file_location(env)
    if path.exists():
        return path
    named = env.get(defaults.CONFIG_FILE_ENV)
    if named:
        raise ConfigError(f"{defaults.CONFIG_FILE_ENV}={named!r}: no such file")
    return None


def resolve_run_config(cli: Mapping[str, object], env: Mapping[str, str], config_file: Path | None) -> RunConfig:
    """The run configuration from every source, highest precedence last.

    `cli` holds the options the user gave, keyed by name with dashes or underscores
    (None values count as not given); `env` is usually os.environ; `config_file` is
    usually find_config_file(os.environ).
    """
    values = _from_config_file(config_file) if config_file is not None else {}
    values |= _from_environment(env)
    values |= _from_command_line(cli)
    return RunConfig(**{_field_name(name): value for name, value in values.items()})


def _from_config_file(path: Path) -> dict[str, object]:
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    values = {}
    for key, raw in table.items():
        name = _option_name(key)
        if name not in _CONVERTERS:
            raise ConfigError(f"{path}: unknown key {key!r}{_suggestion(key)}")
        values[name] = _convert(name, raw, f"{path}: {key} = {raw!r}")
    return values


# Keys that earlier versions read, and what they are called now.
_RENAMED = {"sinks": "keep"}


def _suggestion(key: str) -> str:
    if key.replace("-", "_") in _RENAMED:
        return f" (it is called {_RENAMED[key.replace('-', '_')]!r} now)"
    close = difflib.get_close_matches(key.replace("-", "_"), _CONVERTERS, n=1)
    if not close:
        return f"; the keys are {', '.join(_CONVERTERS)}"
    suggestion = close[0].replace("_", "-") if "-" in key else close[0]  # in the user's spelling
    return f" (did you mean {suggestion!r}?)"


def _from_environment(env: Mapping[str, str]) -> dict[str, object]:
    values = {}
    for name in _CONVERTERS:
        variable = defaults.ENV_PREFIX + name.upper()
        raw = env.get(variable)
        if raw:
            values[name] = _convert(name, raw, f"{variable}={raw!r}")
    return values


def _from_command_line(cli: Mapping[str, object]) -> dict[str, object]:
    values = {}
    for key, raw in cli.items():
        if raw is None:
            continue
        name = _option_name(key)
        if name not in _CONVERTERS:
            raise ValueError(f"{key!r} is not a `streamchat run` option")  # a bug in the caller
        values[name] = _convert(name, raw, f"--{name.replace('_', '-')} {raw}")
    return values


def _convert(name: str, raw: object, label: str) -> Any:
    try:
        return _CONVERTERS[name](raw)
    except ValueError as problem:
        raise ConfigError(f"{label}: {problem}") from None
