"""`streamchat bench decode`: rows side by side, the limit, the checks, and the llama.cpp row's skip note."""

import csv
import importlib.util

import pytest
from typer.testing import CliRunner

from streamchat.bench import decode as bench
from streamchat.bench.commands import bench_app

DECODE_HEADER = [
    "engine",
    "setting",
    "precision",
    "kv_cache",
    "kv_mb_per_token",
    "ms_per_token",
    "aten_calls_per_token",
    "tokens_per_second",
    "limit_ms",
    "x_of_limit",
]


def test_decode_quick_prints_every_row_and_writes_the_csv(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    result = CliRunner().invoke(
        bench_app,
        ["decode", "--quick", "--no-compiled", "--model", str(tiny_model_dir), "--device", "cpu", "--out", str(out)],
        env={"COLUMNS": "250"},
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    with (out / "decode.csv").open(newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        header, rows = reader.fieldnames, list(reader)
    assert header == DECODE_HEADER
    assert [(row["engine"], row["setting"]) for row in rows] == [
        ("streamchat", "run defaults"),
        ("transformers generate() + StaticCache", "run defaults"),
        ("streamchat", "--dtype float32 --quantize none"),
        ("transformers generate() + StaticCache", "--dtype float32 --quantize none"),
    ]
    assert rows[2]["precision"] == "float32"
    # streamchat's rows count the aten calls of a decode step; the others have no count.
    assert [row["aten_calls_per_token"] != "" for row in rows] == [True, False, True, False]
    assert int(rows[0]["aten_calls_per_token"]) > 0 and int(rows[2]["aten_calls_per_token"]) > 0
    assert "aten calls/token" in result.output
    assert all(float(row["ms_per_token"]) > 0 and float(row["x_of_limit"]) > 0 for row in rows)
    assert "streamchat / generate() ms per token, run defaults:" in result.output
    assert "cache 4+60, median of 1" in result.output
    # A model directory has no GGUF file for llama.cpp to read.
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama-cpp-python is not installed" in result.output
    else:
        assert "is not a GGUF file" in result.output


@pytest.mark.parametrize(
    ("dtype", "quantize", "label"),
    [
        ("auto", "auto", "run defaults"),
        ("auto", "int4", "--quantize int4"),
        ("bfloat16", "auto", "--dtype bfloat16"),
        ("float16", "none", "--dtype float16 --quantize none"),
    ],
)
def test_the_main_rows_are_labelled_by_the_options_given(dtype, quantize, label):
    assert bench.run_defaults(dtype, quantize) == bench.Setting(label, dtype, quantize)


def test_a_row_is_one_entry_in_the_list():
    rows = bench.contenders(bench.run_defaults("auto", "auto"), "cpu", compiled=True)
    assert [(row.name, row.setting.label) for row in rows] == [
        ("streamchat", "run defaults"),
        ("streamchat compiled", "run defaults"),
        ("transformers generate() + StaticCache", "run defaults"),
        ("streamchat", "--dtype float32 --quantize none"),
        ("transformers generate() + StaticCache", "--dtype float32 --quantize none"),
    ]
    on_cuda = bench.contenders(bench.run_defaults("auto", "auto"), "cuda", compiled=True)
    assert [row.name for row in on_cuda] == [
        "streamchat",
        "streamchat compiled",
        "transformers generate() + StaticCache",
    ]


def test_random_weights_decode_a_full_cache_without_a_tokenizer(tmp_path):
    out = tmp_path / "results"
    arguments = ["decode", "--quick", "--no-compiled", "--random-init", "tiny", "--full-cache", "--dtype", "float32"]
    result = CliRunner().invoke(
        bench_app, [*arguments, "--quantize", "none", "--out", str(out)], env={"COLUMNS": "250"}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    assert "random tiny on cpu" in result.output and "cache 4+60 full" in result.output
    with (out / "decode.csv").open(newline="", encoding="utf-8") as file:
        assert [row["engine"] for row in csv.DictReader(file)] == [
            "streamchat",
            "transformers generate() + StaticCache",
        ]


def test_checks_compare_the_rows_the_targets_name():
    rows = [
        {"engine": "streamchat", "setting": "run defaults", "ms_per_token": 20.0},
        {"engine": "transformers generate() + StaticCache", "setting": "run defaults", "ms_per_token": 25.0},
        {"engine": "streamchat", "setting": "--dtype float32 --quantize none", "ms_per_token": 60.0},
        {"engine": "llama.cpp", "setting": "x.gguf", "ms_per_token": 10.0},
    ]
    found = {check.name: (check.value, check.met) for check in bench.checks(rows, "run defaults", "cpu")}
    assert found == {
        "run defaults / float32 decode speed": (3.0, True),
        "run defaults / llama.cpp ms per token": (2.0, True),
        "streamchat / generate() ms per token, run defaults": (0.8, True),
    }


def test_on_cuda_the_checks_are_compiled_against_eager_and_the_limit():
    rows = [
        {"engine": "streamchat", "setting": "run defaults", "ms_per_token": 20.0, "x_of_limit": 7.0},
        {"engine": "streamchat compiled", "setting": "run defaults", "ms_per_token": 5.0, "x_of_limit": 1.75},
        {"engine": "transformers generate() + StaticCache", "setting": "run defaults", "ms_per_token": 6.0},
    ]
    found = {check.name: (check.value, check.met) for check in bench.checks(rows, "run defaults", "cuda")}
    assert found == {
        "compiled / eager decode speed": (4.0, True),
        "compiled ms per token / the limit": (1.75, True),
        "streamchat / generate() ms per token, run defaults": (20 / 6, False),
        "streamchat compiled / generate() ms per token, run defaults": (5 / 6, True),
    }


# ---- the float32 rows, where they fit ---------------------------------------------------------


@pytest.mark.parametrize(
    ("parameters", "available", "left_out"),
    [
        (1_000, 4_000, None),  # exactly fits: 4 bytes a parameter
        (1_000, None, None),  # the memory available is unknown (not Linux): assumed to fit
        (1_001, 4_000, "float32 rows left out: their weights need 0.0 GB, 0.0 GB is available"),
        # Llama 2 7B on a 16 GB machine: 27 GB of float32 weights.
        (6_738_415_616, 16 * 10**9, "float32 rows left out: their weights need 27.0 GB, 16.0 GB is available"),
        (6_738_415_616, 27 * 10**9, None),
    ],
)
def test_the_float32_rows_run_only_where_their_weights_fit(parameters, available, left_out):
    assert bench.baseline_left_out(parameters, available) == left_out


def test_without_the_float32_rows_their_check_is_not_made_and_the_others_are():
    rows = [
        {"engine": "streamchat", "setting": "run defaults", "ms_per_token": 20.0},
        {"engine": "transformers generate() + StaticCache", "setting": "run defaults", "ms_per_token": 25.0},
        {"engine": "llama.cpp", "setting": "x.gguf", "ms_per_token": 10.0},
    ]
    found = {check.name for check in bench.checks(rows, "run defaults", "cpu")}
    assert found == {"run defaults / llama.cpp ms per token", "streamchat / generate() ms per token, run defaults"}


def test_no_baseline_leaves_the_float32_rows_out_and_the_table_says_so(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    arguments = ["decode", "--quick", "--no-compiled", "--no-baseline", "--model", str(tiny_model_dir)]
    result = CliRunner().invoke(
        bench_app, [*arguments, "--device", "cpu", "--out", str(out)], env={"COLUMNS": "250"}, catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    with (out / "decode.csv").open(newline="", encoding="utf-8") as file:
        assert [(row["engine"], row["setting"]) for row in csv.DictReader(file)] == [
            ("streamchat", "run defaults"),
            ("transformers generate() + StaticCache", "run defaults"),
        ]
    assert "float32 rows left out: --no-baseline" in result.output
    assert "float32 decode speed" not in result.output
    assert "streamchat / generate() ms per token, run defaults:" in result.output


def test_the_help_says_when_the_float32_rows_run():
    result = CliRunner().invoke(bench_app, ["decode", "--help"], env={"COLUMNS": "250"})
    words = " ".join(result.output.replace("│", " ").split())
    assert result.exit_code == 0
    assert "in float32 unquantized (unless --no-baseline, or where its weights would not fit in the memory" in words
    assert "--no-baseline On CPU, also time the model in float32 unquantized, where its weights" in words
