"""Tables fitted to a terminal, and whole when stdout is a pipe or a file."""

import io

from rich.console import Console
from rich.table import Table

from streamchat.interface.tables import print_table

HUB_ID = "meta-llama/Llama-2-7b-chat-hf"


def hub_table() -> Table:
    table = Table(box=None, pad_edge=False)
    table.add_column("alias", no_wrap=True)
    table.add_column("resolves to", overflow="fold")
    table.add_column("figure", no_wrap=True)
    table.add_row("llama-2-7b-chat", HUB_ID, "1,234.56")
    table.add_row("tiny", "x", "7")
    return table


def test_in_a_pipe_every_row_stays_on_one_line_whole_without_trailing_spaces():
    pipe = Console(file=io.StringIO(), width=30)
    print_table(pipe, hub_table())
    assert pipe.file.getvalue() == (
        "alias            resolves to                    figure\n"
        "llama-2-7b-chat  meta-llama/Llama-2-7b-chat-hf  1,234.56\n"
        "tiny             x                              7\n"
    )


def test_on_a_terminal_the_table_fits_the_width():
    terminal = Console(file=io.StringIO(), width=30, force_terminal=True, color_system=None)
    print_table(terminal, hub_table())
    lines = terminal.file.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 30
    assert HUB_ID not in terminal.file.getvalue()  # folded across lines to fit
