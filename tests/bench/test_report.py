"""Tables, CSV files and checks, shared by both benchmarks."""

import math

import pytest
from rich.console import Console

from streamchat.bench.report import Check, Column, print_report, save_plot, write_csv
from streamchat.errors import ConfigError

COLUMNS = [Column("policy", "policy"), Column("ppl", "PPL", "{:.2f}"), Column("tokens", "tokens", "{:,}")]
ROWS = [{"policy": "dense", "ppl": 12.3456, "tokens": 20000}, {"policy": "window", "ppl": None, "tokens": 5}]


def test_the_table_formats_values_and_marks_missing_ones():
    console = Console(width=120, record=True)
    checks = [Check("window / streaming PPL", 2.04, 1.5, at_most=False), Check("drift", 1.2, 1.1, at_most=True)]
    print_report(console, "Perplexity", COLUMNS, ROWS, checks, caption="a caption")
    text = console.export_text()
    assert "12.35" in text and "20,000" in text and "–" in text and "a caption" in text
    assert "window / streaming PPL: 2.040 (target >= 1.5) met" in text
    assert "drift: 1.200 (target <= 1.1) missed" in text


def test_csv_keeps_full_precision_and_leaves_missing_cells_empty(tmp_path):
    path = write_csv(
        tmp_path / "deep" / "out.csv", ["policy", "ppl", "tokens"], [*ROWS, {"policy": "x", "ppl": math.nan}]
    )
    assert path.read_text(encoding="utf-8").splitlines() == [
        "policy,ppl,tokens",
        "dense,12.3456,20000",
        "window,,5",
        "x,,",
    ]


def test_an_unwritable_output_is_a_one_line_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match=r"cannot write .*; choose another --out directory"):
        write_csv(blocker / "out.csv", ["a"], [])
    with pytest.raises(ConfigError, match="cannot write"):
        save_plot(blocker / "plot.png", lambda figure: figure.subplots().plot([1, 2]))
