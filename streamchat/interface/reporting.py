"""How failures reach the user: one line on stderr and an exit code, never a traceback."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, suppress

import typer
from rich.console import Console
from rich.text import Text

from streamchat.errors import StreamchatError
from streamchat.interface.safe_text import safe_text
from streamchat.interface.signals import Terminated

# What shells report for a process ended by Ctrl-C: 128 + SIGINT.
INTERRUPTED_EXIT_CODE = 130

# Rich drops colour when stderr is not a terminal or NO_COLOR is set; soft wrapping keeps
# each message on one line for logs and scripts.
stderr = Console(stderr=True, soft_wrap=True, highlight=False, emoji=False)


@contextmanager
def reported_errors() -> Iterator[None]:
    """Turn domain errors, Ctrl-C, SIGHUP and SIGTERM inside the block into a message and an exit code."""
    try:
        yield
    except StreamchatError as error:
        # Messages quote what the user gave (a file name, an option's value): shown terminal-safe.
        stderr.print(Text.assemble(("error:", "bold red"), " ", safe_text(str(error))))
        raise typer.Exit(error.exit_code) from None
    except KeyboardInterrupt:
        _last_words("interrupted")
        raise typer.Exit(INTERRUPTED_EXIT_CODE) from None
    except Terminated as terminated:
        _last_words(f"stopped by {terminated.name}")
        raise typer.Exit(terminated.exit_code) from None


def _last_words(text: str) -> None:
    # After SIGHUP the terminal may be gone: a line nobody can read must not become a traceback.
    with suppress(OSError):
        stderr.print(text)


def notify(text: str) -> None:
    """A one-line progress note (loading names files and models): terminal-safe, on stderr."""
    stderr.print(safe_text(text))


def watched_note(text: str) -> None:
    """A note that something slow has begun (loading the model), for whoever watches the terminal: on stderr
    when it is one. A pipe or a log gets nothing, as it gets no live display: only warnings and errors."""
    if stderr.is_terminal:
        stderr.print(safe_text(text, "dim"))
