"""`streamchat bench ppl|speed --quick` end to end through the Typer sub-app: tables, CSV files, plots, errors."""

import csv
import math
import sys
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

from streamchat.bench.commands import bench_app

PPL_HEADER = [
    "policy",
    "cache",
    "tokens",
    "ppl",
    "ppl_reference",
    "ppl_tail",
    "tail_vs_reference",
    "vs_recompute",
    "seconds",
    "tokens_per_second",
]
SPEED_HEADER = [
    "streamed",
    "fill",
    "streaming_ms",
    "dense_ms",
    "recompute_ms",
    "streaming_vs_dense",
    "recompute_vs_streaming",
    "streaming_mib",
    "dense_mib",
    "recompute_mib",
]


def invoke(*args: str):
    # Wide, so that table rows stay on one line each.
    return CliRunner().invoke(bench_app, list(args), env={"COLUMNS": "250"}, catch_exceptions=False)


def flat(text: str) -> str:
    """`text` without whitespace: a table's title wraps at the table's width, inside a long model path too."""
    return "".join(text.split())


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or []), list(reader)


def test_ppl_quick_writes_the_table_the_csv_files_and_the_plot(tiny_model_dir, text_file, tmp_path):
    out = tmp_path / "results"
    result = invoke("ppl", "--quick", "--text", str(text_file), "--model", str(tiny_model_dir), "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "Perplexity:" in result.output and "cache 4+60, chunk 16" in result.output
    for policy, cache in (("dense", "every token"), ("window", "0+64"), ("recompute", "64, recomputed")):
        assert policy in result.output and cache in result.output
    assert "streaming / recompute PPL:" in result.output
    header, rows = read_csv(out / "ppl.csv")
    assert header == PPL_HEADER
    assert [row["policy"] for row in rows] == ["dense", "window", "recompute", "streaming", "keep"]
    assert rows[4]["cache"] == "16+48"  # a longer kept prefix, the same capacity as streaming's
    assert "keep 16 / streaming PPL, same capacity:" in result.output
    for row in rows:
        assert int(row["tokens"]) == 384
        for key in ("ppl", "ppl_reference", "ppl_tail"):
            assert math.isfinite(float(row[key])) and float(row[key]) > 1
        assert float(row["seconds"]) > 0
    assert float(rows[2]["vs_recompute"]) == 1
    header, curve = read_csv(out / "ppl-curve.csv")
    assert header[:3] == ["token", "dense_ppl", "dense_running_ppl"] and len(header) == 11
    assert [int(row["token"]) for row in curve] == [*range(32, 384, 32), 383]
    assert (out / "ppl.png").read_bytes().startswith(b"\x89PNG")


def test_ppl_runs_only_the_policies_asked(tiny_model_dir, text_file, tmp_path):
    args = ("ppl", "--quick", "--text", str(text_file), "--model", str(tiny_model_dir), "--out", str(tmp_path))
    result = invoke(*args, "--policies", "streaming,window", "--tokens", "200")
    assert result.exit_code == 0, result.output
    _, rows = read_csv(tmp_path / "ppl.csv")
    assert [(row["policy"], row["tokens"], row["vs_recompute"]) for row in rows] == [
        ("window", "200", ""),
        ("streaming", "200", ""),
    ]
    assert "window / streaming PPL:" in result.output and "recompute PPL" not in result.output


def test_speed_quick_on_a_random_preset_writes_the_table_the_csv_and_the_plot(tmp_path):
    result = invoke(
        "speed", "--quick", "--random-init", "tiny", "--dtype", "float32", "--quantize", "none", "--out", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    assert "Decode speed: random tiny on cpu (float32), cache 4+60, median of 3 steps" in result.output
    assert "recompute / streaming latency, cache 64 (worst):" in result.output
    header, rows = read_csv(tmp_path / "speed.csv")
    assert header == SPEED_HEADER
    assert [(row["streamed"], row["fill"]) for row in rows] == [("64", "64"), ("128", "64"), ("256", "64")]
    for row in rows:
        assert all(float(row[key]) > 0 for key in SPEED_HEADER)
    assert (tmp_path / "speed.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("spelling", ["--keep", "--sinks"])  # --sinks: the earlier name
def test_speed_runs_a_loaded_model_with_the_sizes_given(spelling, tiny_model_dir, tmp_path):
    args = ("speed", "--model", str(tiny_model_dir), spelling, "2", "--window", "14", "--out", str(tmp_path))
    result = invoke(*args, "--checkpoints", "8,40", "--steps", "1")
    assert result.exit_code == 0, result.output
    assert flat("cache 2+14, median of 1 steps") in flat(result.output)
    _, rows = read_csv(tmp_path / "speed.csv")
    assert [(row["streamed"], row["fill"]) for row in rows] == [("8", "8"), ("40", "16")]


@pytest.mark.parametrize("spelling", ["--keep", "--sinks"])  # --sinks: the earlier name
def test_ppl_keep_is_the_first_tokens_streaming_keeps_and_longer_keep_the_keep_policys(
    spelling, tiny_model_dir, text_file, tmp_path
):
    args = ("ppl", "--quick", "--text", str(text_file), "--model", str(tiny_model_dir), "--out", str(tmp_path))
    result = invoke(*args, "--policies", "streaming,keep", "--tokens", "200", spelling, "20", "--longer-keep", "30")
    assert result.exit_code == 0, result.output
    assert flat("cache 20+60, chunk 16") in flat(result.output)
    _, rows = read_csv(tmp_path / "ppl.csv")
    assert [(row["policy"], row["cache"]) for row in rows] == [("streaming", "20+60"), ("keep", "30+50")]


def test_ppl_keep_no_longer_sets_the_keep_policys_prefix(tiny_model_dir, text_file, tmp_path):
    args = ("ppl", "--quick", "--text", str(text_file), "--model", str(tiny_model_dir), "--out", str(tmp_path))
    result = invoke(*args, "--policies", "streaming,keep", "--tokens", "200", "--keep", "30")
    assert result.exit_code == 0, result.output
    _, rows = read_csv(tmp_path / "ppl.csv")
    assert [(row["policy"], row["cache"]) for row in rows] == [("streaming", "30+60"), ("keep", "16+74")]


def test_the_help_names_keep_first_and_explains_what_ppl_keep_means_now():
    speed = invoke("speed", "--help")
    assert speed.exit_code == 0 and "--keep,--sinks" in speed.output
    ppl = invoke("ppl", "--help")
    assert ppl.exit_code == 0 and "--keep,--sinks" in ppl.output and "--longer-keep" in ppl.output
    words = " ".join(ppl.output.replace("│", " ").split())  # the help wraps at the terminal's width
    assert "--keep is the number of first tokens streaming keeps, as for `run`" in words
    assert "The keep policy's prefix, which --keep set here before, is --longer-keep." in words


def test_without_matplotlib_the_plot_is_skipped_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    result = invoke("speed", "--quick", "--random-init", "tiny", "--checkpoints", "64", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "matplotlib is not installed, so no plot was drawn (pip install 'streamchat[bench]')" in result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["speed.csv"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("ppl", "--text", "missing.txt"), "error: --text missing.txt: no such file"),
        (("ppl", "--text", "{text}", "--policies", "sinks"), "error: --policies 'sinks': choose from dense,"),
        (("ppl", "--text", "{text}", "--quick", "--chunk", "0"), "error: --chunk 0: must be at least 1"),
        (("speed", "--model", "x", "--random-init", "tiny"), "error: --model and --random-init exclude each other"),
        (("speed", "--random-init", "gpt-5"), "error: --random-init 'gpt-5': not a preset (llama-2-7b,"),
        (("speed", "--random-init", "tiny", "--checkpoints", "9,x"), "error: --checkpoints '9,x': give whole numbers"),
        (("speed", "--random-init", "tiny", "--device", "cuda"), "error: --device cuda: torch sees no CUDA GPU"),
    ],
)
def test_mistakes_are_one_line_errors(args, message, text_file):
    if "--device" in args and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    result = invoke(*(arg.replace("{text}", str(text_file)) for arg in args))
    assert result.exit_code == 2
    [line] = result.output.strip().splitlines()
    assert line.startswith(message)


def test_the_sub_app_mounts_as_streamchat_bench(tmp_path):
    app = typer.Typer()
    app.add_typer(bench_app, name="bench")
    listed = CliRunner().invoke(app, ["bench", "--help"], env={"COLUMNS": "250"})
    assert listed.exit_code == 0 and "ppl" in listed.output and "speed" in listed.output
    result = CliRunner().invoke(
        app, ["bench", "speed", "--quick", "--random-init", "tiny", "--checkpoints", "64", "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    assert (tmp_path / "speed.csv").exists()


def test_display_writes_the_table_and_the_csv(tiny_model_dir, tmp_path):
    args = ("display", "--model", str(tiny_model_dir), "--trials", "2", "--max-new-tokens", "4", "--window", "40")
    result = invoke(*args, "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "Display overhead:" in result.output
    assert "app / engine decode speed (medians):" in result.output
    assert f"wrote {tmp_path / 'display.csv'}" in result.output
    header, rows = read_csv(tmp_path / "display.csv")
    assert header == ["trial", "engine", "app"] and [row["trial"] for row in rows] == ["1", "2"]
    assert all(float(row["engine"]) > 0 and float(row["app"]) > 0 for row in rows)


@pytest.mark.parametrize("bench", ["ppl", "speed", "keep", "recall", "display", "decode", "serve"])
def test_every_bench_that_runs_a_model_takes_the_kv_cache_format(bench, text_file):
    # Checked as run checks it, before a model loads (the model named here does not exist).
    needed = {"ppl": ("--text", str(text_file)), "keep": ("--transcript", str(text_file), "--turns", "1")}
    result = invoke(bench, *needed.get(bench, ()), "--model", "no-such-model", "--kv-cache", "q8")
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == "error: --kv-cache q8: must be one of auto, full, int8"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--trials", "0"), "error: --trials 0: must be at least 1"),
        (("--max-new-tokens", "1"), "error: --max-new-tokens 1: must be at least 2"),
    ],
)
def test_display_refuses_impossible_sizes_before_loading_a_model(args, message, tmp_path):
    result = invoke("display", "--model", str(tmp_path / "no-such-model"), *args)
    assert result.exit_code == 2
    assert result.output.strip() == message


def test_running_out_of_cpu_memory_is_a_one_line_error(tiny_model_dir, text_file, tmp_path, monkeypatch):
    from streamchat.bench import ppl, speed

    def out_of_cpu_memory(*args: object, **kwargs: object) -> None:
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: 9 GB")

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise MemoryError

    monkeypatch.setattr(speed.StreamingDecoder, "feed", out_of_cpu_memory)
    monkeypatch.setattr(ppl, "dense_nll", out_of_memory)
    for args, smaller in (
        (("speed", "--quick", "--random-init", "tiny", "--device", "cpu"), "--window"),
        (("ppl", "--quick", "--text", str(text_file), "--model", str(tiny_model_dir)), "--tokens or --window"),
    ):
        result = invoke(*args, "--out", str(tmp_path / "results"))
        assert result.exit_code == 6, result.output
        assert result.output.strip().splitlines()[-1] == (
            f"error: the benchmark ran out of memory: try a smaller {smaller}, --dtype bfloat16 or float16, "
            "or a smaller model"
        )
        assert "Traceback" not in result.output
    assert not (tmp_path / "results").exists()


def test_the_benches_read_the_model_options_and_the_window_from_the_environment_like_run(
    tiny_model_dir, tmp_path, monkeypatch
):
    monkeypatch.setenv("STREAMCHAT_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("STREAMCHAT_WINDOW", "40")
    result = invoke("display", "--trials", "2", "--max-new-tokens", "4", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert flat(f"{tiny_model_dir.name}, cache 4+40, 4 tokens per reply") in flat(result.output)


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({"STREAMCHAT_DTYPE": "fp16"}, ("decode", "--quick"), "STREAMCHAT_DTYPE='fp16': must be one of auto, float32"),
        ({"STREAMCHAT_WINDOW": "abc"}, ("display",), "STREAMCHAT_WINDOW='abc': not an integer"),
        ({"STREAMCHAT_QUANTIZE": "int2"}, ("speed", "--quick"), "STREAMCHAT_QUANTIZE='int2': must be one of auto"),
    ],
)
def test_a_bad_environment_value_stops_a_bench_before_loading_and_names_the_variable(
    env, args, message, tmp_path, monkeypatch
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = invoke(*args, "--out", str(tmp_path))
    assert result.exit_code == 2
    assert result.output.strip().startswith(f"error: {message}")
