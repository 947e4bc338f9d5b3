"""The configuration of `run`, `info` and the benches: command line > environment > config file > defaults.

Every option can be given on the command line (--max-new-tokens 256), in the environment
(STREAMCHAT_MAX_NEW_TOKENS=256; empty counts as unset; booleans are 1/0, true/false,
yes/no, on/off) and in the TOML config file (max_new_tokens = 256 or max-new-tokens = 256:
$STREAMCHAT_CONFIG, else config.toml in the user config directory, which may be missing).

Each value is checked where it is read, so a bad one is reported with its source even
when a higher-precedence source overrides it. Sampling options left unset stay None:
the engine then uses the model's generation config.
"""

from __future__ import annotations

import difflib
import keyword
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import platformdirs

from streamchat import defaults
from streamchat.cache.ledger import SMALLEST_WINDOW
from streamchat.conversation.kept_prefix import parse_keep
from streamchat.conversation.session_options import eviction_policy, recall_mode
from streamchat.errors import ConfigError
from streamchat.generation.settings import SAMPLING_RULES
from streamchat.interface.transcript import (
    OUTPUT_FORMATS,
    TRANSCRIPT_FORMATS,
    TURN_SPLITS,
    OutputFormat,
    TranscriptFormat,
    TurnSplit,
)
from streamchat.interface.values import (
    Converter,
    boolean,
    checked,
    checked_by,
    integer,
    number,
    one_of,
    stop_strings,
    text,
    word_or_number,
)
from streamchat.loading import LoadOptions
from streamchat.placement.device import DEVICE_NAMES, DTYPE_NAMES, is_device_name, is_dtype_name
from streamchat.placement.quantization import KV_CACHE_NAMES, QUANTIZE_NAMES, is_kv_cache_name, is_quantize_name

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

CONFIG_FILE_NAME = "config.toml"


def _sampling(name: str) -> Any:
    """A sampling option, unset by default, checked by the engine's own rule for it."""
    rule = SAMPLING_RULES[name]
    convert = integer if rule.kind is int else number
    return _option(None, checked(convert, rule.accepts, f"must be {rule.limits}"))


def _option(default: object, convert: Converter) -> Any:
    return field(default=default, metadata={"convert": convert})


_NOT_EMPTY = checked(text, bool, "must not be empty")
_KEEP = checked_by(parse_keep, f"{defaults.KEEP_SYSTEM!r} (the system turn) or a whole number of first tokens >= 0")
_TP = word_or_number(
    defaults.TP_AUTO, 1, f"must be a number of ranks >= 1, or {defaults.TP_AUTO!r} (as many as torchrun started)"
)


@dataclass(frozen=True)
class RunConfig:
    """Everything `streamchat run` needs to know, each option with the rule that checks it."""

    model: str = _option(defaults.DEFAULT_MODEL, _NOT_EMPTY)
    keep: str | int = _option(defaults.KEEP, _KEEP)  # "system", or a number of first tokens
    window: int = _option(
        defaults.WINDOW, checked(integer, lambda n: n >= SMALLEST_WINDOW, f"must be >= {SMALLEST_WINDOW}")
    )
    max_new_tokens: int | None = _sampling("max_new_tokens")  # None: the model's, else defaults.MAX_NEW_TOKENS
    temperature: float | None = _sampling("temperature")
    top_p: float | None = _sampling("top_p")
    top_k: int | None = _sampling("top_k")
    min_p: float | None = _sampling("min_p")
    repetition_penalty: float | None = _sampling("repetition_penalty")
    frequency_penalty: float | None = _sampling("frequency_penalty")
    presence_penalty: float | None = _sampling("presence_penalty")
    seed: int | None = _sampling("seed")
    stop: tuple[str, ...] | None = _option(None, stop_strings)
    system: str | None = _option(None, text)
    json_schema: str | None = _option(None, _NOT_EMPTY)  # a file: every reply is one JSON value of its schema
    # Which machine has the device, and which device takes which quantization, is settled at load time.
    device: str = _option(defaults.DEVICE, checked(text, is_device_name, f"must be one of {DEVICE_NAMES}"))
    dtype: str = _option(defaults.DTYPE, checked(text, is_dtype_name, f"must be one of {DTYPE_NAMES}"))
    quantize: str = _option(defaults.QUANTIZE, checked(text, is_quantize_name, f"must be one of {QUANTIZE_NAMES}"))
    kv_cache: str = _option(defaults.KV_CACHE, checked(text, is_kv_cache_name, f"must be one of {KV_CACHE_NAMES}"))
    device_map: str | None = _option(None, text)
    eviction: str = _option(
        defaults.EVICTION_POLICY, checked_by(eviction_policy, f"one of {', '.join(defaults.EVICTION_POLICIES)}")
    )
    read_all: bool = _option(defaults.READ_ALL, boolean)
    recall: str = _option(defaults.RECALL, checked_by(recall_mode, f"one of {', '.join(defaults.RECALL_MODES)}"))
    compile: str = _option(defaults.COMPILE, one_of(defaults.COMPILE_SETTINGS))
    trust_remote_code: bool = _option(False, boolean)
    allow_pickle: bool = _option(False, boolean)
    markdown: bool = _option(False, boolean)
    transcript: str | None = _option(None, text)
    transcript_format: TranscriptFormat = _option(defaults.TRANSCRIPT_FORMAT, one_of(TRANSCRIPT_FORMATS))
    turns: TurnSplit = _option(defaults.TRANSCRIPT_TURNS, one_of(TURN_SPLITS))
    output_format: OutputFormat = _option(defaults.OUTPUT_FORMAT, one_of(OUTPUT_FORMATS))
    continue_: bool = _option(False, boolean)  # `continue`: go on with the most recent session
    resume: str | None = _option(None, _NOT_EMPTY)  # a session file or id to go on with
    # Tensor parallelism: N ranks (this command starts them), "auto" (join torchrun's), None or 1: one process.
    tp: int | str | None = _option(None, _TP)

    def __post_init__(self) -> None:
        # Direct construction (tests, other commands) gets the same checks as resolve_run_config.
        for option in fields(self):
            value = getattr(self, option.name)
            if value is not None or option.default is not None:
                name = _option_name(option.name)
                _convert(name, value, f"{name}={value!r}")


# Earlier names that still work, in the config file, the environment (STREAMCHAT_EVICT, STREAMCHAT_SINKS) and on
# the command line: `sinks = 4` kept the first 4 tokens, as `keep = 4` does.
_ALIASES = {"evict": "eviction", "sinks": "keep"}


def _option_name(name: str) -> str:
    """The option a RunConfig field, a config key or a command-line parameter names: `continue_` is `continue`."""
    name = name.replace("-", "_").rstrip("_")
    return _ALIASES.get(name, name)


# The options by name (the config file's keys), each with its rule.
_CONVERTERS: dict[str, Converter] = {
    _option_name(option.name): option.metadata["convert"] for option in fields(RunConfig)
}


def load_options(config: RunConfig) -> LoadOptions:
    """What loading the model needs to know, from a run's configuration."""
    return LoadOptions(
        model=config.model,
        device=config.device,
        dtype=config.dtype,
        quantize=config.quantize,
        kv_cache=config.kv_cache,
        device_map=config.device_map,
        trust_remote_code=config.trust_remote_code,
        allow_pickle=config.allow_pickle,
    )


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


def load_run_config(command_line: Mapping[str, object]) -> RunConfig:
    """The run configuration from the options given, this process's environment and its config file."""
    return resolve_run_config(command_line, os.environ, find_config_file(os.environ))


def chosen_options(command_line: Mapping[str, object]) -> frozenset[str]:
    """The options this run sets itself, by name: on the command line, in the environment or the config file.
    The others are defaults, which a conversation gone on with may replace by its own."""
    return frozenset(name for name, _, _ in _given(command_line, os.environ, find_config_file(os.environ)))


def resolve_run_config(cli: Mapping[str, object], env: Mapping[str, str], config_file: Path | None) -> RunConfig:
    """The run configuration from every source: each value is checked, and the latest source wins.

    `cli` holds the options the user gave, keyed by name with dashes or underscores
    (None values count as not given).
    """
    checked_values = {name: _convert(name, raw, label) for name, raw, label in _given(cli, env, config_file)}
    return RunConfig(**{_field_name(name): value for name, value in checked_values.items()})


def replaced(config: RunConfig, values: Mapping[str, object], source: str) -> RunConfig:
    """`config` with `values` (raw, by option name) in place of its own, each checked by its option's rule;
    ConfigError names `source` and the value."""
    checked_values = {name: _convert(name, raw, f"{source}: {name} = {raw!r}") for name, raw in values.items()}
    return replace(config, **{_field_name(name): value for name, value in checked_values.items()})


def _field_name(name: str) -> str:
    return name + "_" if keyword.iskeyword(name) else name


# (option, raw value, how the message names where it came from)
Given = tuple[str, object, str]


def _given(cli: Mapping[str, object], env: Mapping[str, str], config_file: Path | None) -> list[Given]:
    """Every value given, by every source, the config file's first and the command line's last."""
    return [
        *(_from_config_file(config_file) if config_file else []),
        *_from_environment(env),
        *_from_command_line(cli),
    ]


def _from_config_file(path: Path) -> list[Given]:
    try:
        table = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"{path}: invalid TOML: {error}") from None
    for key in table:
        if _option_name(key) not in _CONVERTERS:
            raise ConfigError(f"{path}: unknown key {key!r}{_suggestion(key)}")
    return [(_option_name(key), raw, f"{path}: {key} = {raw!r}") for key, raw in table.items()]


def _suggestion(key: str) -> str:
    close = difflib.get_close_matches(key.replace("-", "_"), _CONVERTERS, n=1)
    if not close:
        return f"; the keys are {', '.join(_CONVERTERS)}"
    suggestion = close[0].replace("_", "-") if "-" in key else close[0]  # in the user's spelling
    return f" (did you mean {suggestion!r}?)"


def _from_environment(env: Mapping[str, str]) -> list[Given]:
    variables = {key: defaults.ENV_PREFIX + key.upper() for key in [*_ALIASES, *_CONVERTERS]}  # aliases first: lose
    return [(_option_name(key), env[name], f"{name}={env[name]!r}") for key, name in variables.items() if env.get(name)]


def _from_command_line(cli: Mapping[str, object]) -> list[Given]:
    for key in cli:
        if _option_name(key) not in _CONVERTERS:
            raise ValueError(f"{key!r} is not a `streamchat run` option")  # a bug in the caller
    return [
        (_option_name(key), raw, f"--{_option_name(key).replace('_', '-')} {raw}")
        for key, raw in cli.items()
        if raw is not None
    ]


def _convert(name: str, raw: object, label: str) -> Any:
    try:
        return _CONVERTERS[name](raw)
    except ValueError as problem:
        raise ConfigError(f"{label}: {problem}") from None
