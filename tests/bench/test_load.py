"""`streamchat bench load`: first and later starts in fresh processes, their peak RSS, the disk the first adds;
a child's failure as its own one-line error."""

import csv
import importlib.util
import os
import signal
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streamchat.bench import load as bench
from streamchat.bench.commands import bench_app
from streamchat.errors import ConfigError, ModelAccessError, StreamchatError
from streamchat.measure.models import ModelChoice
from tests.support.gguf_files import write_tiny_gguf

LOAD_HEADER = [
    "engine",
    "start",
    "starts",
    "seconds",
    "peak_rss_gb",
    "disk_added_gb",
    "seconds_vs_llama_cpp",
    "peak_rss_vs_llama_cpp",
]
# float32 unquantized on any CPU: no CPU kernels to build in the fresh cache, whatever the machine.
FLOAT32 = ("--device", "cpu", "--dtype", "float32", "--quantize", "none")


def invoke(*args: str):
    return CliRunner().invoke(bench_app, ["load", *args], env={"COLUMNS": "250"}, catch_exceptions=False)


def flat(text: str) -> str:
    """`text` without whitespace: a table's title wraps at the table's width, inside a long model path too."""
    return "".join(text.split())


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or []), list(reader)


def test_quick_times_a_first_and_a_later_start_and_the_disk_only_the_first_adds(tmp_path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    users_cache = Path(os.environ["STREAMCHAT_CACHE_DIR"])  # the tests' own, standing in for the user's
    before = sorted(path.name for path in users_cache.iterdir())
    out = tmp_path / "results"
    result = invoke("--quick", "--model", str(gguf), *FLOAT32, "--out", str(out))
    assert result.exit_code == 0, result.output
    assert flat(f"Start-up: {gguf}, a fresh process per start, later: median of 1") in flat(result.output)
    assert "streamchat first start:" in result.output and "streamchat later start:" in result.output
    header, rows = read_csv(out / "load.csv")
    assert header == LOAD_HEADER
    streamchat = [row for row in rows if row["engine"] == "streamchat"]
    assert [(row["start"], row["starts"]) for row in streamchat] == [("first", "1"), ("later", "1")]
    for row in streamchat:
        assert float(row["seconds"]) > 0
        # A Python process that imported torch and loaded a model: tens of megabytes at the very least.
        assert float(row["peak_rss_gb"]) > 0.02
    first, later = streamchat
    assert float(first["disk_added_gb"]) > 0  # the GGUF file's tokenizer and config, read once into the cache
    assert float(later["disk_added_gb"]) == 0
    # The first start's cache was a new one: the user's gained nothing.
    assert sorted(path.name for path in users_cache.iterdir()) == before
    if importlib.util.find_spec("llama_cpp") is None:
        assert (
            "llama.cpp row skipped: llama-cpp-python is not installed (pip install 'streamchat[llamacpp]')"
            in " ".join(result.output.split())
        )
        assert len(rows) == 2 and first["seconds_vs_llama_cpp"] == ""
    else:
        [llama] = [row for row in rows if row["engine"] == "llama.cpp"]
        assert (llama["start"], llama["starts"], llama["disk_added_gb"]) == ("later", "1", "")
        assert float(later["seconds_vs_llama_cpp"]) > 0 and float(later["peak_rss_vs_llama_cpp"]) > 0


def test_a_model_that_does_not_load_is_the_childs_own_one_line_error(tmp_path):
    missing = str(tmp_path / "no-such-model")
    result = invoke("--model", missing, "--out", str(tmp_path / "results"))
    # As `streamchat info --model MISSING` (the child) says it, with its exit code.
    assert (result.exit_code, result.output) == (3, f"error: no such file or directory: {missing}\n")
    assert not (tmp_path / "results").exists()


def test_options_are_checked_before_any_process_starts(tmp_path):
    result = invoke("--trials", "0", "--model", str(tmp_path / "no-such-model"))
    assert (result.exit_code, result.output) == (2, "error: --trials 0: must be at least 1\n")
    result = invoke("--dtype", "fp16", "--model", str(tmp_path / "no-such-model"))
    assert result.exit_code == 2 and result.output.startswith("error: --dtype fp16: must be one of auto")


def test_the_help_says_what_a_start_is_and_what_the_first_start_has():
    result = invoke("--help")
    words = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 0
    assert "Each start is a fresh `streamchat info` process, which loads the model as `run` does." in words
    assert "The first has an empty cache of its own (STREAMCHAT_CACHE_DIR: a new temporary directory)" in words
    assert "--trials" in words and "--quick" in words


# ---- one start ---------------------------------------------------------------------------------


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_start_is_timed_to_its_first_output_and_its_peak_rss_is_its_own():
    # 200 MiB touched, then freed, before the first line: the peak stays, the process ends small.
    code = "b = bytearray(200 * 2**20); b[::4096] = b'x' * len(b[::4096]); del b; print('loaded', flush=True)"
    start = bench.timed_start(python(code), os.environ)
    assert start.seconds > 0
    assert start.peak_rss >= 200 * 2**20
    assert bench.timed_start(python("print('loaded')"), os.environ).peak_rss < 150 * 2**20


def test_a_child_that_fails_is_the_error_its_exit_code_names_with_its_last_line():
    code = "import sys; sys.stderr.write('a warning\\nerror: the hub is offline\\n'); sys.exit(4)"
    with pytest.raises(ModelAccessError, match=r"^the hub is offline$"):
        bench.timed_start(python(code), os.environ)
    code = "import sys; sys.stderr.write('error: cannot write the converted model\\n'); sys.exit(1)"
    with pytest.raises(StreamchatError, match=r"^cannot write the converted model$") as raised:
        bench.timed_start(python(code), os.environ)
    assert raised.value.exit_code == 1
    # A crash is no domain error: its last line, the exception, said as such.
    with pytest.raises(ConfigError, match=r"^streamchat exited with code 1: ValueError: bad weights$"):
        bench.timed_start(python("raise ValueError('bad weights')"), os.environ)
    with pytest.raises(ConfigError, match=r"^llama.cpp exited with code 3: error: no$"):
        bench.timed_start(python("import sys; sys.stderr.write('error: no'); sys.exit(3)"), os.environ, "llama.cpp")
    with pytest.raises(ConfigError, match=r"^streamchat wrote nothing on stdout: and nothing on stderr$"):
        bench.timed_start(python("pass"), os.environ)
    killed = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(ConfigError, match=rf"^streamchat was ended by signal {int(signal.SIGKILL)}: "):
        bench.timed_start(python(killed), os.environ)


def test_the_child_is_streamchat_info_with_the_model_options_given():
    assert bench.info_command(ModelChoice("m", None, "float32", None)) == [
        sys.executable,
        "-m",
        "streamchat",
        "info",
        "--model",
        "m",
        "--dtype",
        "float32",
    ]


def test_disk_counts_the_bytes_of_the_files_under_the_cache(tmp_path):
    assert bench.directory_bytes(tmp_path / "none yet") == 0
    (tmp_path / "converted" / "entry").mkdir(parents=True)
    (tmp_path / "converted" / "entry" / "model.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "tokenizer.json").write_bytes(b"y" * 24)
    (tmp_path / "link").symlink_to(tmp_path / "tokenizer.json")
    assert bench.directory_bytes(tmp_path) == 1024 + len(str(tmp_path / "tokenizer.json"))


def test_rows_take_the_median_seconds_the_highest_peak_and_ratios_over_llama_cpp():
    gb = 10**9
    later = bench.row("streamchat", "later", [bench.Start(2.0, 3 * gb), bench.Start(4.0, 2 * gb)], 0)
    llama = bench.row("llama.cpp", "later", [bench.Start(1.0, gb), bench.Start(1.5, gb), bench.Start(8.0, gb)])
    assert later == {
        "engine": "streamchat",
        "start": "later",
        "starts": 2,
        "seconds": 3.0,
        "peak_rss_gb": 3.0,
        "disk_added_gb": 0.0,
    }
    assert llama["seconds"] == 1.5 and llama["disk_added_gb"] is None
    assert bench.with_ratios(later, llama) == later | {"seconds_vs_llama_cpp": 2.0, "peak_rss_vs_llama_cpp": 3.0}
