"""One `streamchat bench` command, whichever bench: sizes -> measure -> report -> save.

A command declares its options and two steps, and run_bench runs them, any error a one-line report: the sizes
first, so that every option is checked before a model loads; then the measurement, which loads the model and ends
in a Report (an allocation failure on the way names the options that shrink the run: building random weights, as
--random-init llama-2-13b on a small machine, runs out of memory too); then the report's tables are printed with
their checks and written as CSV files, with its plots, into --out.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from rich.console import Console

from streamchat.interface.reporting import reported_errors, stderr
from streamchat.measure.report import Check, Column, CsvTable, Row, print_report, save_results

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Sizes = TypeVar("Sizes")  # a bench's sizes (PplSizes, SpeedSizes, ...), checked when built


@dataclass(frozen=True)
class ReportTable:
    """One table of a report: printed with its checks and caption, and written into --out as the CSV file `csv`."""

    csv: str
    title: str
    columns: Sequence[Column]
    rows: Sequence[Row]
    checks: Sequence[Check] = ()
    caption: str | None = None


@dataclass(frozen=True)
class Report:
    """What a bench shows and keeps: its tables; CSV files not printed (curves, every request); PNG plots."""

    tables: Sequence[ReportTable]
    more_csv: Mapping[str, CsvTable] = field(default_factory=dict)
    plots: Mapping[str, Callable[[Figure], None]] = field(default_factory=dict)


def run_bench(out: Path, sizes: Callable[[], Sizes], measure: Callable[[Sizes], Report], smaller: str | None) -> None:
    """Size, measure and report one bench, then show and save the report; any error one line on stderr.

    `smaller` names the options that shrink the run, for an allocation failure while it measures (None: it
    allocates nothing worth naming, as a bench of other processes).
    """
    # Imported here, not above: torch loads only once a command runs, never for `streamchat --help`.
    from streamchat.measure.memory import out_of_memory_errors

    with reported_errors():
        chosen = sizes()
        with out_of_memory_errors(smaller) if smaller is not None else nullcontext():
            report = measure(chosen)
        show_and_save(report, out)


def show_and_save(report: Report, out: Path) -> None:
    """Print the report's tables on stdout, then write its files into `out` and say which."""
    # Made per run, not at import, so the width follows the terminal (or COLUMNS) of this run.
    stdout = Console(highlight=False, emoji=False)
    for table in report.tables:
        print_report(stdout, table.title, table.columns, table.rows, list(table.checks), table.caption)
    tables = {table.csv: ([column.key for column in table.columns], table.rows) for table in report.tables}
    save_results(out, {**tables, **report.more_csv}, dict(report.plots), console=stdout, notes=stderr)
