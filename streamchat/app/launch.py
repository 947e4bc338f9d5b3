"""`streamchat run`, after the options: load the model, build the session, chat or play a transcript.

Interactive when stdin and stdout are terminals and no --transcript is given;
otherwise user turns come from the transcript (or the pipe) and the conversation goes
to stdout. Piped stdin never reaches prompt_toolkit.
"""

from __future__ import annotations

import gc
import itertools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.text import Text

from streamchat import __version__
from streamchat.app.resuming import session_to_resume
from streamchat.app.typeahead import keys_held
from streamchat.errors import StreamchatError
from streamchat.interface.config import RunConfig, load_options
from streamchat.interface.display import ChatDisplay
from streamchat.interface.reporting import notify, reported_errors, stderr, watched_note
from streamchat.interface.safe_text import safe_text
from streamchat.interface.transcript import TranscriptItem, read_transcript, read_transcript_file, transcript_writer
from streamchat.loading import LoadedModel, LoadOptions
from streamchat.placement.quantization import precision_label
from streamchat.sessions.building import driven_session_for, json_format_file
from streamchat.sessions.keeping import data_dir, save_state, state_key

if TYPE_CHECKING:
    from prompt_toolkit.formatted_text import StyleAndTextTuples

    from streamchat.conversation.calls import Conversation
    from streamchat.conversation.driven import DrivenSession
    from streamchat.storage.cache_file import StateKey
    from streamchat.storage.journal import Journal


# Builds the session a run drives from the model loaded, and what its cache states are valid for
# (None: none are written or restored). Tensor parallelism builds rank 0's (app/tensor_parallel.py).
SessionFactory = Callable[[RunConfig, LoadedModel], "tuple[Conversation, StateKey | None]"]


def run_chat(config: RunConfig, load: Callable[[LoadOptions], LoadedModel], build: SessionFactory | None = None) -> int:
    """Chat or play a transcript with `config`; `load(options)` loads the model (the CLI's loader)."""
    interactive = config.transcript is None and sys.stdin.isatty() and sys.stdout.isatty()
    # Opened and read up to its first item before the model loads, so that a missing, empty or
    # binary transcript fails at once; the rest is read as the turns run (stdin may be a live pipe).
    items = None if interactive else _first_read(_transcript_items(config))
    # Which conversation to go on with, also settled before the model loads.
    resume = session_to_resume(config, data_dir() / "sessions")
    if config.json_schema is not None:
        json_format_file(config.json_schema)  # a schema the replies cannot be held to fails now, not after the load
    announce_load(config.model)
    # Keys typed while the model loads wait, whole and unechoed, for the first prompt.
    with keys_held() if interactive else nullcontext():
        loaded = load(load_options(config))
        session, key = (build or _session_and_key)(config, loaded)
    if config.continue_ and resume is None:
        stderr.print("no saved session to continue: this is a new one", highlight=False)
    kept = session.cache_stats().sink_capacity
    if loaded.max_context and kept + config.window > loaded.max_context:
        stderr.print(
            f"[yellow]warning:[/] a cache of {kept + config.window:,} tokens is longer than the "
            f"{loaded.max_context:,} {loaded.source.name} was trained on; expect worse replies (try --window "
            f"{max(1, loaded.max_context - kept)})",
            highlight=False,
        )
    if items is None:  # interactive: no transcript is read
        return _interactive(config, loaded, session, resume, key)
    return _piped(config, loaded, session, items, resume, key)


def _interactive(
    config: RunConfig, loaded: LoadedModel, session: Conversation, resume: Path | None, key: StateKey | None
) -> int:
    from streamchat.app.chat import ChatApp
    from streamchat.app.repl import Prompter, toolbar_text

    console = Console(highlight=False, emoji=False)
    display = ChatDisplay(console, markdown=config.markdown)

    def toolbar() -> StyleAndTextTuples:
        stats = session.cache_stats()
        return toolbar_text(stats if stats.seen else None, console.width)

    prompter = Prompter(data_dir() / "history", lambda: [key for key, _ in session.options()], toolbar)
    display.notice(_banner(config, loaded, session))
    journal = _journal(config, loaded, display.error)
    app = ChatApp(session, display, prompter, loaded.source.name, journal, key)
    # Under --tp a second Ctrl-C must not tear a step off on rank 0 alone: it stops the reply, like the first.
    app.abandon_on_second_interrupt = not session.steps_in_lockstep
    return app.run(resume)


def _piped(
    config: RunConfig,
    loaded: LoadedModel,
    session: Conversation,
    items: Iterator[TranscriptItem],
    resume: Path | None,
    key: StateKey | None,
) -> int:
    from streamchat.app.piped import resume_conversation, run_transcript

    display = ChatDisplay(stderr, show_text=False) if stderr.is_terminal else None
    writer = transcript_writer(config.output_format, sys.stdout)
    if config.system and resume is None:  # a conversation gone on with keeps its own system prompt
        writer.write_message("system", config.system)

    def report(text: str) -> None:
        stderr.print(Text.assemble(("warning: ", "yellow"), safe_text(text)), highlight=False)

    journal = _journal(config, loaded, report)
    try:
        if resume is not None:
            resume_conversation(session, journal, resume, key, display, report)
        return run_transcript(session, items, writer, display, report, journal)
    finally:
        try:
            save_state(session, journal.path if journal.failure is None else None, key)
        except StreamchatError as error:
            report(str(error))
        journal.close()
        if display is not None and journal.path is not None and journal.failure is None:
            with suppress(OSError):  # after SIGHUP, nobody may be there to read it
                display.notice(f"saved to {journal.path} (streamchat run --continue goes on with it)")


def _journal(config: RunConfig, loaded: LoadedModel, on_error: Callable[[str], None]) -> Journal:
    from streamchat.storage.journal import Journal

    cache = {"keep": config.keep, "window": config.window}
    return Journal(data_dir() / "sessions", loaded.source.name, cache, on_error)


def _first_read(items: Iterator[TranscriptItem]) -> Iterator[TranscriptItem]:
    first = next(items, None)
    return items if first is None else itertools.chain([first], items)


def _transcript_items(config: RunConfig) -> Iterator[TranscriptItem]:
    transcript_format, turns = config.transcript_format, config.turns
    if config.transcript is not None:
        return read_transcript_file(config.transcript, transcript_format=transcript_format, turns=turns)
    return read_transcript(sys.stdin.buffer, "<stdin>", transcript_format=transcript_format, turns=turns)


def announce_load(model: str) -> None:
    """Say on the terminal that `model` is loading, which takes seconds to a minute or more; first check
    that it names a model at all (instantly: an alias, a path, a hub id), so that a typo is the only line."""
    from streamchat.loading.resolve import resolve_model

    with reported_errors():
        resolve_model(model)
    watched_note(f"loading {model} ...")


def load(options: LoadOptions) -> LoadedModel:
    """Load the model, progress notes on stderr, failures as one line and an exit code."""
    from streamchat.loading import load_model

    with reported_errors(), _garbage_collection_paused():
        return load_model(options, notify=notify)


@contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    """Skip cyclic garbage collection while loading, then exempt what loading created from it.

    Importing torch and transformers and building a model allocate millions of objects that
    live as long as the process. Collections along the way find nothing to free, and at exit
    the interpreter walks them all once more: together about 1.5 s of a 5 s start of the
    default model. Frozen, they are skipped by every later collection, and at exit.
    """
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _session_and_key(config: RunConfig, loaded: LoadedModel) -> tuple[DrivenSession, StateKey]:
    return driven_session_for(config, loaded), state_key(config, loaded)


def _banner(config: RunConfig, loaded: LoadedModel, session: Conversation) -> str:
    precision = precision_label(loaded.dtype, loaded.quantization)
    return (
        f"streamchat {__version__} · {loaded.source.name} ({loaded.model_type}) on {loaded.device} {precision} · "
        f"cache {session.cache_stats().sink_capacity} sinks (--keep {config.keep}) + {config.window:,} window · "
        "/help for commands, Ctrl-D to leave"
    )
