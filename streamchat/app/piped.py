"""Transcript mode: user turns from a file or a pipe, the conversation to stdout.

All turns run through one session. The transcript goes to stdout in the chosen
format; the live cache display and eviction notes go to stderr, only when stderr is a
terminal. A malformed line is reported on stderr and skipped; the run goes on and
exits with the transcript error code at the end. Ctrl-C stops the current reply and
ends the run; so do SIGHUP and SIGTERM, with the transcript ending on a whole turn.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from streamchat.app.resuming import load_session
from streamchat.conversation.calls import Conversation
from streamchat.errors import TranscriptError
from streamchat.generation.events import Event, NotResumed, PromptSkipped, TextDelta, TurnFinished
from streamchat.interface.display import ChatDisplay, prompt_skipped_text
from streamchat.interface.reporting import INTERRUPTED_EXIT_CODE
from streamchat.interface.signals import interrupts_handled, termination_deferred
from streamchat.interface.transcript import SkippedLine, SystemPrompt, TranscriptItem, TranscriptWriter, UserTurn
from streamchat.storage.cache_file import StateKey
from streamchat.storage.journal import Journal


def run_transcript(
    session: Conversation,
    items: Iterable[TranscriptItem],
    writer: TranscriptWriter,
    display: ChatDisplay | None,
    report: Any,
    journal: Journal,
) -> int:
    """Play every turn, recorded in `journal`; return the exit code. `report(text)` prints a one-line problem."""
    skipped = 0
    interrupted = False

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal interrupted
        interrupted = True
        session.stop()

    with interrupts_handled(on_interrupt):
        for item in items:
            if interrupted:  # a Ctrl-C between turns, or while waiting for the next line
                break
            if isinstance(item, SkippedLine):
                report(str(item.error))
                skipped += 1
            elif isinstance(item, SystemPrompt):
                with termination_deferred(session.stop):
                    _render(session.set_system_prompt(item.text), display)
                    journal.record(session.snapshot(tensors=False))
                    if item.text:
                        writer.write_message("system", item.text)
            elif isinstance(item, UserTurn):
                # SIGHUP or SIGTERM stop the reply, and the run ends once the turn is written whole.
                with termination_deferred(session.stop):
                    _play_turn(session, item.text, writer, display, journal, report)
    if interrupted:
        return INTERRUPTED_EXIT_CODE
    return TranscriptError.exit_code if skipped else 0


def resume_conversation(
    session: Conversation,
    journal: Journal,
    path: Path,
    key: StateKey | None,
    display: ChatDisplay | None,
    report: Any,
) -> None:
    """Go on with the conversation saved at `path` before the transcript's turns (--continue, --resume).

    Why its cache state could not be restored, if so, is a warning line without a live display.
    """
    events, saved = load_session(session, journal, path, key)
    if display is None:
        events = _not_resumed_reported(events, report)
    with termination_deferred(session.stop):
        _render(events, display)
    journal.record(session.snapshot(tensors=False))
    if saved.unanswered is not None:
        report(f"the last message in {path} never got its reply (the session ended first), so it was left out")


def _not_resumed_reported(events: Iterator[Event], report: Any) -> Iterator[Event]:
    for event in events:
        if isinstance(event, NotResumed):
            report(f"not resumed exactly, replayed: {event.reason}")
        yield event


def _play_turn(
    session: Conversation,
    text: str,
    writer: TranscriptWriter,
    display: ChatDisplay | None,
    journal: Journal,
    report: Any,
) -> None:
    journal.record_user(session.snapshot(tensors=False), text)
    finished = None
    events = session.chat(text)
    if display is None:  # no live display to say it: a prompt read in part is worth a warning line
        events = _skips_reported(events, report)
    try:
        writer.write_message("user", text)
        writer.start_reply()
        finished = _render(_written(events, writer), display)
    finally:
        # Also when the turn failed (a closed pipe, an error): the reply as far as it went.
        journal.record(session.snapshot(tensors=False), finished.stats.stop_reason if finished else None)
    writer.end_reply(_stats(finished))


def _skips_reported(events: Iterator[Event], report: Any) -> Iterator[Event]:
    for event in events:
        if isinstance(event, PromptSkipped):
            report(prompt_skipped_text(event))
        yield event


def _written(events: Iterator[Event], writer: TranscriptWriter) -> Iterator[Event]:
    for event in events:
        if isinstance(event, TextDelta):
            writer.write_delta(event.text)
        yield event


def _render(events: Iterator[Event], display: ChatDisplay | None) -> TurnFinished | None:
    finished = None

    def watched() -> Iterator[Event]:
        nonlocal finished
        for event in events:
            if isinstance(event, TurnFinished):
                finished = event
            yield event

    if display is None:
        for _ in watched():
            pass
    else:
        display.show(watched())
    return finished


def _stats(finished: TurnFinished | None) -> dict[str, object] | None:
    if finished is None:
        return None
    # Counts only: timings would make the same run write different bytes.
    stats = finished.stats
    return {
        "prompt_tokens": stats.prompt_tokens,
        "generated_tokens": stats.generated_tokens,
        "stop_reason": stats.stop_reason,
    }
