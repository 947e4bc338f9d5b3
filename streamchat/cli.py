"""The `streamchat` console script, the top of the house: it wires the app's commands, the server and the bench.

torch and transformers are imported only by the commands that load a model, so
`--version`, `--help` and `models` answer at once.
"""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from streamchat import __version__
from streamchat.app import commands as app_commands
from streamchat.app.tensor_parallel import with_optional_tp_value
from streamchat.bench.commands import bench_app
from streamchat.interface import signals
from streamchat.interface.options import Command, Group
from streamchat.serve.command import serve

app = typer.Typer(
    name="streamchat",
    cls=Group,
    no_args_is_help=True,
    add_completion=False,
    # Locals would dump tensors and tokens into a bug report's traceback.
    pretty_exceptions_show_locals=False,
)
app.command(cls=Command)(app_commands.models)
app.command(cls=Command)(app_commands.sessions)
app.command(cls=Command)(app_commands.info)
app.command(cls=Command, epilog=app_commands.RUN_EPILOG)(app_commands.run)
app.command(cls=Command)(serve)
app.add_typer(bench_app, name="bench")


def main() -> None:
    """The console script: signals become exceptions, so that every way out runs the same cleanup."""
    signals.install()
    sys.argv[1:] = with_optional_tp_value(sys.argv[1:])
    try:
        app()
    except signals.Terminated as terminated:  # outside any command's own handling (option parsing)
        sys.exit(terminated.exit_code)


def _show_version(requested: bool) -> None:
    if requested:
        typer.echo(f"streamchat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """Endless terminal chat with local Hugging Face models through a sink-preserving rolling KV cache."""
