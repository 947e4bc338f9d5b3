"""How benchmark results leave the process: a Rich table, CSV files, target checks and a PNG plot.

A benchmark describes its results as rows (dicts) and Columns; the same rows become
the table on screen and the CSV on disk. matplotlib is optional (the `bench` extra):
without it the plot is skipped with a one-line note.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from streamchat.errors import ConfigError
from streamchat.interface.tables import print_table
from streamchat.storage.durable import write_durably

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Row = dict[str, Any]
# A CSV file's header and rows.
CsvTable = tuple[Sequence[str], Sequence[Row]]
MISSING = "–"


@dataclass(frozen=True)
class Column:
    """One column: `key` in the rows and the CSV header, `header` and `fmt` on screen."""

    key: str
    header: str
    fmt: str = "{}"

    def show(self, value: Any) -> str:
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return MISSING
        return self.fmt.format(value)


@dataclass(frozen=True)
class Check:
    """A claim the benchmark tests, e.g. "streaming / recompute PPL" <= 1.05."""

    name: str
    value: float
    target: float
    at_most: bool  # True: the value must not exceed the target; False: it must reach it

    @property
    def met(self) -> bool:
        return self.value <= self.target if self.at_most else self.value >= self.target

    def describe(self) -> str:
        sign = "<=" if self.at_most else ">="
        verdict = "[green]met[/]" if self.met else "[red]missed[/]"
        return f"{self.name}: {self.value:.3f} (target {sign} {self.target:g}) {verdict}"


def table(title: str, columns: Sequence[Column], rows: Sequence[Row], caption: str | None = None) -> Table:
    shown = Table(title=title, title_justify="left", caption=caption, caption_justify="left")
    for column in columns:
        shown.add_column(column.header, justify="left" if column.fmt == "{}" else "right", no_wrap=True)
    for row in rows:
        shown.add_row(*(column.show(row.get(column.key)) for column in columns))
    return shown


def print_report(
    console: Console,
    title: str,
    columns: Sequence[Column],
    rows: Sequence[Row],
    checks: list[Check],
    caption: str | None = None,
) -> None:
    print_table(console, table(title, columns, rows, caption))
    for check in checks:
        console.print(f"  {check.describe()}")


def write_csv(path: Path, columns: Sequence[str], rows: Sequence[Row]) -> Path:
    """Rows as CSV with `columns` as the header; missing values are empty cells."""

    def write(temporary: Path) -> None:
        with temporary.open("w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, fieldnames=list(columns), extrasaction="ignore")
            writer.writeheader()
            for row in rows:
                writer.writerow({key: _csv_value(row.get(key)) for key in columns})

    with _writing(path):
        write_durably(path, write)
    return path


MATPLOTLIB_MISSING = "matplotlib is not installed, so no plot was drawn (pip install 'streamchat[bench]')"


def save_plot(path: Path, draw: Callable[[Figure], None], size: tuple[float, float] = (12.0, 4.5)) -> Path | None:
    """Draw a figure into `path` (PNG); None when matplotlib is not installed."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    # A bare Figure renders through Agg without pyplot: no GUI backend, no global state.
    figure = Figure(figsize=size, layout="constrained")
    draw(figure)
    with _writing(path):
        write_durably(path, lambda temporary: figure.savefig(temporary, format="png", dpi=120))
    return path


def save_results(
    out: Path,
    tables: dict[str, CsvTable],
    plots: dict[str, Callable[[Figure], None]],
    *,
    console: Console,
    notes: Console,
) -> list[Path]:
    """Write each table as a CSV file and each plot as a PNG, named by their keys, into `out`.

    The files written are listed on `console`; a missing matplotlib is noted on `notes`.
    """
    written = [write_csv(out / name, columns, rows) for name, (columns, rows) in tables.items()]
    for name, draw in plots.items():
        plot = save_plot(out / name, draw)
        if plot is None:
            notes.print(MATPLOTLIB_MISSING, markup=False)
            break
        written.append(plot)
    console.print("wrote " + ", ".join(str(path) for path in written), markup=False)
    return written


def _csv_value(value: Any) -> Any:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return value


@contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Within the block, which writes `path` (creating its directory), a failure is a one-line error."""
    try:
        yield
    except OSError as error:
        raise ConfigError(f"cannot write {path} ({error.strerror or error}); choose another --out directory") from None
