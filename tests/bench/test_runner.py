"""One bench run, whichever bench: the sizes checked first, the measurement's failures one line, the report saved."""

import csv

import pytest
import typer

from streamchat.bench.runner import Report, ReportTable, run_bench
from streamchat.errors import ConfigError
from streamchat.measure.report import Check, Column

COLUMNS = [Column("policy", "policy"), Column("ppl", "PPL", "{:.2f}")]
ROWS = [{"policy": "dense", "ppl": 12.5}, {"policy": "window", "ppl": 30.25}]


def report() -> Report:
    return Report(
        [
            ReportTable(
                "main.csv", "Perplexity: tiny", COLUMNS, ROWS, [Check("window / dense", 2.42, 3, at_most=True)]
            ),
            ReportTable("cost.csv", "Cost", [Column("seconds", "s", "{:.1f}")], [{"seconds": 1.5}], caption="why"),
        ],
        more_csv={"curve.csv": (["token", "ppl"], [{"token": 1, "ppl": 2.0}])},
    )


def test_the_report_is_printed_then_each_table_and_each_more_csv_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # the "wrote ..." line on one line
    run_bench(tmp_path, lambda: 3, lambda sizes: report(), "--window")
    printed = capsys.readouterr().out
    assert printed.index("Perplexity: tiny") < printed.index("window / dense: 2.420 (target <= 3) met")
    assert printed.index("met") < printed.index("Cost") < printed.index("why") < printed.index("wrote ")
    written = [tmp_path / name for name in ("main.csv", "cost.csv", "curve.csv")]
    assert printed.strip().splitlines()[-1] == "wrote " + ", ".join(map(str, written))
    with (tmp_path / "main.csv").open(newline="", encoding="utf-8") as file:
        assert list(csv.DictReader(file)) == [{"policy": "dense", "ppl": "12.5"}, {"policy": "window", "ppl": "30.25"}]


def test_bad_sizes_stop_the_run_before_anything_is_measured(tmp_path, capsys):
    def sizes() -> int:
        raise ConfigError("--window 2: must be at least 8")

    measured = []
    with pytest.raises(typer.Exit) as stopped:
        run_bench(tmp_path / "out", sizes, measured.append, "--window")
    assert (stopped.value.exit_code, measured) == (2, [])
    assert capsys.readouterr().err.strip() == "error: --window 2: must be at least 8"
    assert not (tmp_path / "out").exists()


def out_of_memory(sizes: int) -> Report:
    raise MemoryError


def test_running_out_of_memory_names_the_options_that_shrink_the_run(tmp_path, capsys):
    with pytest.raises(typer.Exit) as stopped:
        run_bench(tmp_path, lambda: 3, out_of_memory, "--tokens or --window")
    assert stopped.value.exit_code == 6
    assert (
        capsys.readouterr()
        .err.strip()
        .startswith("error: the benchmark ran out of memory: try a smaller --tokens or --window,")
    )


def test_a_bench_of_other_processes_gives_no_advice_about_its_own_sizes(tmp_path):
    with pytest.raises(MemoryError):
        run_bench(tmp_path, lambda: 3, out_of_memory, None)
