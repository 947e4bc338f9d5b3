"""Tables, CSV files and checks, shared by both benchmarks."""

import io
import math
import sys

import pytest
from rich.console import Console

from streamchat.errors import ConfigError
from streamchat.measure.report import (
    MATPLOTLIB_MISSING,
    Check,
    Column,
    print_report,
    save_plot,
    save_results,
    write_csv,
)

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


def test_a_report_written_to_a_log_keeps_every_column_whole_however_narrow_the_console():
    log = Console(file=io.StringIO(), width=16)  # not a terminal: a file or a pipe
    print_report(log, "Perplexity", COLUMNS, ROWS, [])
    lines = log.file.getvalue().splitlines()
    assert "…" not in log.file.getvalue()
    assert [line.split() for line in lines if "dense" in line or "window" in line] == [
        ["│", "dense", "│", "12.35", "│", "20,000", "│"],
        ["│", "window", "│", "–", "│", "5", "│"],
    ]


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


def test_results_are_saved_as_csv_files_and_plots_and_listed(tmp_path):
    console, notes = Console(width=300, record=True), Console(width=300, record=True)
    written = save_results(
        tmp_path / "out",
        {"a.csv": (["policy", "ppl"], ROWS), "b.csv": (["tokens"], ROWS)},
        {"a.png": lambda figure: figure.subplots().plot([1, 2])},
        console=console,
        notes=notes,
    )
    assert written == [tmp_path / "out" / name for name in ("a.csv", "b.csv", "a.png")]
    assert (tmp_path / "out" / "b.csv").read_text(encoding="utf-8").splitlines() == ["tokens", "20000", "5"]
    assert (tmp_path / "out" / "a.png").read_bytes().startswith(b"\x89PNG")
    assert console.export_text().strip() == "wrote " + ", ".join(str(path) for path in written)
    assert notes.export_text() == ""


def test_without_matplotlib_only_the_csv_files_are_saved_with_a_note(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    console, notes = Console(width=300, record=True), Console(width=300, record=True)
    written = save_results(
        tmp_path, {"a.csv": (["policy"], ROWS)}, {"a.png": lambda figure: None}, console=console, notes=notes
    )
    assert written == [tmp_path / "a.csv"] and sorted(path.name for path in tmp_path.iterdir()) == ["a.csv"]
    assert notes.export_text().strip() == MATPLOTLIB_MISSING
