"""`streamchat bench recall` end to end on a tiny model."""

import csv

from typer.testing import CliRunner

from streamchat.bench.commands import bench_app


def test_recall_quick_writes_the_table_the_csv_files_and_the_plot(tiny_model_dir, tmp_path):
    out = tmp_path / "results"
    arguments = ["recall", "--quick", "--model", str(tiny_model_dir), "--out", str(out)]
    result = CliRunner().invoke(bench_app, arguments, env={"COLUMNS": "250"}, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    output = " ".join(result.output.split())
    assert "2 facts through a 160-token window" in output
    assert "share of the log-prob gap recall recovers:" in output
    with (out / "recall.csv").open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert [row["question"] for row in rows] == [
        "What is my sister's name?",
        "What is the door code?",
        "mean over the facts",
        "distractor: What is my brother's name?",
    ]
    with (out / "recall-cost.csv").open(newline="") as file:
        costs = list(csv.DictReader(file))
    assert [row["turns"] for row in costs] == ["8", "10", "100"]
    assert (out / "recall.png").read_bytes().startswith(b"\x89PNG")
