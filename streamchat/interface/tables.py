"""Tables on stdout: fitted to a terminal, whole in a pipe or a file.

Rich fits a table to the console's width, folding or cutting cells with an ellipsis. On
a terminal that is what the user wants; in `streamchat models | grep llama` or a
benchmark log it breaks ids across lines and turns figures into `…`. When the output is
not a terminal, a table is laid out as wide as its content needs, so every row stays on
one line, whole.
"""

from __future__ import annotations

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.segment import Segment, Segments

# Wider than any table streamchat prints: the width a table is measured in before printing it whole.
_UNBOUNDED = 1_000_000


def print_table(console: Console, table: RenderableType) -> None:
    """Print `table` on `console`: fitted to a terminal's width, else at its full width."""
    if console.is_terminal:
        console.print(table)
        return
    full_width = Measurement.get(console, console.options.update_width(_UNBOUNDED), table).maximum
    # Laid out at its own width, then written as it is: soft wrapping neither wraps nor crops lines.
    lines = console.render_lines(table, console.options.update_width(max(full_width, 1)), pad=False)
    segments = [segment for line in lines for segment in [*_trimmed(line), Segment.line()]]
    console.print(Segments(segments), soft_wrap=True, end="")


def _trimmed(line: list[Segment]) -> list[Segment]:
    """A line without the spaces that pad its last cell: noise in a file, and in every grep."""
    while line and not line[-1].text.strip():
        line = line[:-1]
    if not line:
        return []
    last = line[-1]
    return [*line[:-1], Segment(last.text.rstrip(), last.style)]
