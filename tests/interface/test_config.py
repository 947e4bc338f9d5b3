from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.interface.config import (
    RunConfig,
    config_file_location,
    find_config_file,
    resolve_run_config,
)


def config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def error_of(cli: dict[str, object], env: dict[str, str], path: Path | None = None) -> str:
    with pytest.raises(ConfigError) as raised:
        resolve_run_config(cli, env, path)
    return str(raised.value)


def test_defaults_come_from_defaults_py_and_sampling_stays_unset() -> None:
    config = resolve_run_config({}, {}, None)
    assert config == RunConfig()
    assert (config.model, config.keep, config.window, config.max_new_tokens) == (
        defaults.DEFAULT_MODEL,
        "system",
        defaults.WINDOW,
        None,
    )
    assert (config.device, config.dtype, config.quantize, config.eviction) == (
        defaults.DEVICE,
        defaults.DTYPE,
        defaults.QUANTIZE,
        defaults.EVICTION_POLICY,
    )
    assert (config.temperature, config.top_p, config.top_k, config.min_p) == (None, None, None, None)
    assert (config.repetition_penalty, config.seed, config.system, config.device_map) == (None,) * 4
    assert (config.frequency_penalty, config.presence_penalty) == (None, None)
    assert (config.trust_remote_code, config.allow_pickle, config.markdown) == (False, False, False)
    assert (config.transcript, config.transcript_format, config.turns, config.output_format) == (
        None,
        "auto",
        "line",
        "text",
    )


@pytest.mark.parametrize(
    ("in_file", "in_env", "on_command_line", "window"),
    [
        (None, None, None, defaults.WINDOW),
        (100, None, None, 100),
        (None, "200", None, 200),
        (100, "200", None, 200),
        (None, None, 300, 300),
        (100, None, 300, 300),
        (None, "200", 300, 300),
        (100, "200", 300, 300),
    ],
)
def test_command_line_beats_environment_beats_file_beats_defaults(
    tmp_path: Path, in_file: int | None, in_env: str | None, on_command_line: int | None, window: int
) -> None:
    path = config_file(tmp_path, f"window = {in_file}\n" if in_file is not None else "")
    env = {"STREAMCHAT_WINDOW": in_env} if in_env is not None else {}
    cli = {"window": on_command_line} if on_command_line is not None else {}
    assert resolve_run_config(cli, env, path).window == window


def test_sources_combine_with_their_native_types(tmp_path: Path) -> None:
    path = config_file(
        tmp_path,
        """
model = "my-model"
max-new-tokens = 256
temperature = 1
top_p = 0.5
trust-remote-code = true
device = "cuda:1"
turns = "blank-line"
""",
    )
    env = {
        "STREAMCHAT_KEEP": "8",
        "STREAMCHAT_MIN_P": "0.05",
        "STREAMCHAT_SEED": "7",
        "STREAMCHAT_ALLOW_PICKLE": "yes",
        "STREAMCHAT_SYSTEM": "Be brief.",
        "STREAMCHAT_EVICT": "turn",
        "STREAMCHAT_OUTPUT_FORMAT": "jsonl",
        "STREAMCHAT_CACHE_DIR": "/elsewhere",  # not a run option: ignored here
    }
    cli = {
        "top-k": 40,
        "repetition_penalty": 1.1,
        "dtype": "bfloat16",
        "markdown": True,
        "transcript": "example",
    }
    config = resolve_run_config(cli, env, path)
    assert config == RunConfig(
        model="my-model",
        keep=8,
        max_new_tokens=256,
        temperature=1.0,
        top_p=0.5,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=7,
        system="Be brief.",
        device="cuda:1",
        dtype="bfloat16",
        eviction="turn",
        trust_remote_code=True,
        allow_pickle=True,
        markdown=True,
        transcript="example",
        turns="blank-line",
        output_format="jsonl",
    )
    assert isinstance(config.temperature, float)


# One valid spelling of every option, as a string, and the value it stands for.
EVERY_OPTION = {
    "model": ("tiny", "tiny"),
    "keep": ("3", 3),
    "window": ("5", 5),
    "max_new_tokens": ("6", 6),
    "temperature": ("0.1", 0.1),
    "top_p": ("0.2", 0.2),
    "top_k": ("9", 9),
    "min_p": ("0.3", 0.3),
    "repetition_penalty": ("1.2", 1.2),
    "frequency_penalty": ("-0.5", -0.5),
    "presence_penalty": ("1.5", 1.5),
    "seed": ("11", 11),
    "stop": ("END", ("END",)),
    "system": ("Be kind.", "Be kind."),
    "json_schema": ("schema.json", "schema.json"),
    "device": ("cpu", "cpu"),
    "dtype": ("float16", "float16"),
    "quantize": ("int4", "int4"),
    "kv_cache": ("int8", "int8"),
    "device_map": ("auto", "auto"),
    "eviction": ("turn", "turn"),
    "read_all": ("true", True),
    "recall": ("off", "off"),
    "compile": ("on", "on"),
    "trust_remote_code": ("1", True),
    "allow_pickle": ("on", True),
    "markdown": ("yes", True),
    "transcript": ("chat.txt", "chat.txt"),
    "transcript_format": ("mtbench", "mtbench"),
    "turns": ("blank-line", "blank-line"),
    "output_format": ("markdown", "markdown"),
    "continue": ("yes", True),
    "resume": ("20250101-120000-3fa2c1", "20250101-120000-3fa2c1"),
    "tp": ("2", 2),
}


@pytest.mark.parametrize("source", ["command line", "environment", "config file"])
def test_every_option_can_be_given_in_every_source(tmp_path: Path, source: str) -> None:
    # `continue` is a Python keyword: its field is `continue_`.
    assert set(EVERY_OPTION) == {option.name.rstrip("_") for option in fields(RunConfig)}
    texts = {name: text for name, (text, _) in EVERY_OPTION.items()}
    if source == "command line":
        config = resolve_run_config(texts, {}, None)
    elif source == "environment":
        config = resolve_run_config({}, {f"STREAMCHAT_{name.upper()}": text for name, text in texts.items()}, None)
    else:
        lines = "".join(f"{name.replace('_', '-')} = {text!r}\n" for name, text in texts.items())
        config = resolve_run_config({}, {}, config_file(tmp_path, lines))
    values = {name: value for name, (_, value) in EVERY_OPTION.items()}
    assert config == RunConfig(**{"continue_" if name == "continue" else name: value for name, value in values.items()})


def test_stop_strings_are_a_list_on_the_command_line_and_in_toml_and_shell_words_in_the_environment(
    tmp_path: Path,
) -> None:
    assert resolve_run_config({"stop": ["END", "two words"]}, {}, None).stop == ("END", "two words")
    assert resolve_run_config({}, {"STREAMCHAT_STOP": "END 'two words'"}, None).stop == ("END", "two words")
    toml = config_file(tmp_path, 'stop = ["END", "two words"]\n')
    assert resolve_run_config({}, {}, toml).stop == ("END", "two words")
    assert error_of({"stop": ["END", ""]}, {}) == "--stop ['END', '']: must be non-empty strings"


@pytest.mark.parametrize(
    ("text", "expected"),
    [(word, True) for word in ("1", "true", "TRUE", "yes", "on", " On ")]
    + [(word, False) for word in ("0", "false", "False", "no", "off")],
)
def test_boolean_environment_variables(text: str, expected: bool) -> None:
    assert resolve_run_config({}, {"STREAMCHAT_TRUST_REMOTE_CODE": text}, None).trust_remote_code is expected


def test_an_empty_environment_variable_counts_as_unset() -> None:
    assert resolve_run_config({}, {"STREAMCHAT_WINDOW": "", "STREAMCHAT_SYSTEM": ""}, None) == RunConfig()


def test_none_on_the_command_line_means_not_given() -> None:
    assert resolve_run_config({"window": None}, {"STREAMCHAT_WINDOW": "64"}, None).window == 64


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STREAMCHAT_WINDOW": "abc"}, "STREAMCHAT_WINDOW='abc': not an integer"),
        (
            {"STREAMCHAT_KEEP": "-1"},
            "STREAMCHAT_KEEP='-1': must be 'system' (the system turn) or a whole number of first tokens >= 0",
        ),
        (
            {"STREAMCHAT_CONTINUE": "maybe"},
            "STREAMCHAT_CONTINUE='maybe': not a boolean (use 1/true/yes/on or 0/false/no/off)",
        ),
        ({"STREAMCHAT_TEMPERATURE": "hot"}, "STREAMCHAT_TEMPERATURE='hot': not a number"),
        ({"STREAMCHAT_TEMPERATURE": "nan"}, "STREAMCHAT_TEMPERATURE='nan': not a finite number"),
        ({"STREAMCHAT_TOP_P": "0"}, "STREAMCHAT_TOP_P='0': must be > 0 and <= 1"),
        ({"STREAMCHAT_MIN_P": "1.5"}, "STREAMCHAT_MIN_P='1.5': must be between 0 and 1"),
        ({"STREAMCHAT_REPETITION_PENALTY": "0"}, "STREAMCHAT_REPETITION_PENALTY='0': must be > 0"),
        ({"STREAMCHAT_FREQUENCY_PENALTY": "3"}, "STREAMCHAT_FREQUENCY_PENALTY='3': must be between -2 and 2"),
        ({"STREAMCHAT_PRESENCE_PENALTY": "x"}, "STREAMCHAT_PRESENCE_PENALTY='x': not a number"),
        ({"STREAMCHAT_PRESENCE_PENALTY": "nan"}, "STREAMCHAT_PRESENCE_PENALTY='nan': not a finite number"),
        (
            {"STREAMCHAT_TRUST_REMOTE_CODE": "sure"},
            "STREAMCHAT_TRUST_REMOTE_CODE='sure': not a boolean (use 1/true/yes/on or 0/false/no/off)",
        ),
        ({"STREAMCHAT_EVICT": "oldest"}, "STREAMCHAT_EVICT='oldest': must be one of token, turn"),
        (
            {"STREAMCHAT_DEVICE": "gpu"},
            "STREAMCHAT_DEVICE='gpu': must be one of auto, cpu, cuda, mps, or cuda:N",
        ),
        (
            {"STREAMCHAT_TRANSCRIPT_FORMAT": "csv"},
            "STREAMCHAT_TRANSCRIPT_FORMAT='csv': must be one of auto, text, jsonl, mtbench",
        ),
    ],
)
def test_bad_environment_values_name_the_variable(env: dict[str, str], message: str) -> None:
    assert error_of({}, env) == message


@pytest.mark.parametrize(
    ("cli", "message"),
    [
        ({"keep": "all"}, "--keep all: must be 'system' (the system turn) or a whole number of first tokens >= 0"),
        ({"continue_": "perhaps"}, "--continue perhaps: not a boolean (use 1/true/yes/on or 0/false/no/off)"),
        ({"max_new_tokens": 0}, "--max-new-tokens 0: must be >= 1"),
        ({"dtype": "fp16"}, "--dtype fp16: must be one of auto, float32, bfloat16, float16"),
        ({"quantize": "int2"}, "--quantize int2: must be one of auto, none, int8, int4"),
        ({"kv_cache": "int4"}, "--kv-cache int4: must be one of auto, full, int8"),
        ({"output-format": "html"}, "--output-format html: must be one of text, jsonl, markdown"),
        ({"compile": "yes"}, "--compile yes: must be one of auto, on, off"),
        ({"model": ""}, "--model : must not be empty"),
    ],
)
def test_bad_command_line_values_name_the_option(cli: dict[str, object], message: str) -> None:
    assert error_of(cli, {}) == message


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "mps", "cuda:0", "cuda:7"])
def test_any_device_name_passes_whatever_this_machine_has(device: str) -> None:
    # Whether the machine has it is settled when the model loads (tests/placement/test_device.py).
    assert resolve_run_config({"device": device}, {}, None).device == device
    assert resolve_run_config({}, {"STREAMCHAT_DEVICE": device}, None).device == device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:-1", "CUDA", "mps:0"])
def test_a_device_that_is_no_name_is_refused(device: str) -> None:
    assert error_of({"device": device}, {}) == f"--device {device}: must be one of auto, cpu, cuda, mps, or cuda:N"


def test_a_bad_value_is_reported_even_when_overridden() -> None:
    assert error_of({"window": 100}, {"STREAMCHAT_WINDOW": "abc"}) == "STREAMCHAT_WINDOW='abc': not an integer"


def test_an_unknown_command_line_key_is_a_bug_in_the_caller() -> None:
    with pytest.raises(ValueError, match="'windw' is not a `streamchat run` option"):
        resolve_run_config({"windw": 1}, {}, None)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("windw = 100\n", "unknown key 'windw' (did you mean 'window'?)"),
        ("max-new-token = 100\n", "unknown key 'max-new-token' (did you mean 'max-new-tokens'?)"),
        ("window = 'big'\n", "window = 'big': not an integer"),
        ("keep = true\n", "keep = True: must be 'system' (the system turn) or a whole number of first tokens >= 0"),
        ("sinks = -1\n", "sinks = -1: must be 'system' (the system turn) or a whole number of first tokens >= 0"),
        ("markdown = 'maybe'\n", "markdown = 'maybe': not a boolean (use 1/true/yes/on or 0/false/no/off)"),
        ("model = 7\n", "model = 7: not a string"),
        ("temperature = -0.5\n", "temperature = -0.5: must be >= 0"),
        (
            "keep = 4\nwindow 2000\n",
            "invalid TOML: Expected '=' after a key in a key/value pair (at line 2, column 8)",
        ),
    ],
)
def test_config_file_errors_name_the_file_and_the_key(tmp_path: Path, text: str, message: str) -> None:
    path = config_file(tmp_path, text)
    assert error_of({}, {}, path) == f"{path}: {message}"


def test_an_unknown_key_without_a_close_match_lists_the_keys(tmp_path: Path) -> None:
    path = config_file(tmp_path, "colour = 'blue'\n")
    message = error_of({}, {}, path)
    assert message.startswith(f"{path}: unknown key 'colour'; the keys are model, keep, window, max_new_tokens,")
    assert message.endswith("transcript, transcript_format, turns, output_format, continue, resume, tp")


def test_a_config_file_that_is_not_utf8_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_bytes("system = 'caf\u00e9'\n".encode("latin-1"))
    assert error_of({}, {}, path) == f"{path}: not UTF-8 text"


def test_streamchat_config_names_the_file_and_must_exist(tmp_path: Path) -> None:
    path = config_file(tmp_path, "keep = 2\n")
    env = {"STREAMCHAT_CONFIG": str(path)}
    assert config_file_location(env) == path
    assert find_config_file(env) == path
    assert resolve_run_config({}, env, find_config_file(env)).keep == 2
    missing = str(tmp_path / "nope.toml")
    with pytest.raises(ConfigError) as raised:
        find_config_file({"STREAMCHAT_CONFIG": missing})
    assert str(raised.value) == f"STREAMCHAT_CONFIG={missing!r}: no such file"


@pytest.mark.skipif(sys.platform != "linux", reason="XDG_CONFIG_HOME is where Linux keeps user config")
def test_the_default_config_file_is_in_the_user_config_dir_and_may_be_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    default = tmp_path / "streamchat" / "config.toml"
    assert config_file_location({}) == default
    assert find_config_file({}) is None
    default.parent.mkdir()
    default.write_text("evict = 'turn'\n")
    assert find_config_file({}) == default


def test_direct_construction_is_validated_too() -> None:
    with pytest.raises(ConfigError, match=r"^window=0: must be >= 1$"):
        RunConfig(window=0)
    with pytest.raises(ConfigError, match=r"^keep=None: must be 'system'"):
        RunConfig(keep=None)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"^continue='perhaps': not a boolean"):
        RunConfig(continue_="perhaps")  # type: ignore[arg-type]


def test_the_old_name_evict_still_works_everywhere_and_the_new_one_wins(tmp_path: Path) -> None:
    assert resolve_run_config({"evict": "turn"}, {}, None).eviction == "turn"
    assert resolve_run_config({}, {"STREAMCHAT_EVICT": "turn"}, None).eviction == "turn"
    assert (
        resolve_run_config({}, {"STREAMCHAT_EVICT": "turn", "STREAMCHAT_EVICTION": "token"}, None).eviction == "token"
    )
    assert resolve_run_config({}, {}, config_file(tmp_path, "evict = 'turn'\n")).eviction == "turn"
    assert error_of({"eviction": "oldest"}, {}) == "--eviction oldest: must be one of token, turn"
    assert error_of({}, {"STREAMCHAT_RECALL": "always"}) == "STREAMCHAT_RECALL='always': must be one of auto, off"


def test_the_old_name_sinks_still_works_everywhere_means_keep_and_the_new_one_wins(tmp_path: Path) -> None:
    assert resolve_run_config({"sinks": 4}, {}, None).keep == 4
    assert resolve_run_config({}, {"STREAMCHAT_SINKS": "4"}, None).keep == 4
    assert resolve_run_config({}, {"STREAMCHAT_SINKS": "4", "STREAMCHAT_KEEP": "system"}, None).keep == "system"
    assert resolve_run_config({}, {}, config_file(tmp_path, "sinks = 4\n")).keep == 4
    assert resolve_run_config({"keep": "6"}, {"STREAMCHAT_SINKS": "4"}, config_file(tmp_path, "sinks = 2\n")).keep == 6
    assert error_of({}, {"STREAMCHAT_SINKS": "all"}) == (
        "STREAMCHAT_SINKS='all': must be 'system' (the system turn) or a whole number of first tokens >= 0"
    )
