"""The interactive chat: read a line, run a turn or a slash command, render, repeat.

The loop drives the engine and hands every event to the display; it renders nothing
itself. Ctrl-C during a reply stops the reply (the session stays consistent); a
second Ctrl-C abandons it, and the cache is rebuilt from the transcript.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from streamchat.app import commands
from streamchat.app.display import ChatDisplay, turn_stats_line
from streamchat.app.repl import Prompter
from streamchat.app.signals import Interrupted, termination_deferred
from streamchat.app.status import status_figures
from streamchat.engine.events import Event, TurnFinished
from streamchat.engine.session import ChatSession
from streamchat.errors import CommandError, StreamchatError


@dataclass
class ChatApp:
    session: ChatSession
    display: ChatDisplay
    prompter: Prompter
    model_name: str
    sessions_dir: Path

    def __post_init__(self) -> None:
        self.turns = 0
        self.last_turn: TurnFinished | None = None

    def run(self) -> int:
        try:
            while (line := self.prompter.read()) is not None:
                try:
                    item = commands.parse_line(line)
                    if isinstance(item, commands.Message):
                        if item.text.strip():
                            self.turn(self.session.chat(item.text))
                    elif self.command(item) is commands.Quit:
                        break
                except StreamchatError as error:
                    self.display.error(str(error))
        finally:
            # However the chat ends (Ctrl-C while the cache is rebuilt, a bug), the conversation is saved.
            self.goodbye()
        return 0

    def turn(self, events: Iterator[Event]) -> None:
        try:
            with termination_deferred(self.session.stop), _stop_on_interrupt(self.session), _keys_not_echoed():
                self.display.show(self._counted(events))
        except KeyboardInterrupt:
            self.display.notice("reply abandoned; rebuilding the cache from the transcript")
            self.display.show(self.session.recover())
        except StreamchatError as error:
            # A turn that failed half way (out of memory, say) must not leave the cache torn.
            self.display.error(str(error))
            self.display.show(self.session.recover())

    def _counted(self, events: Iterator[Event]) -> Iterator[Event]:
        for event in events:
            if isinstance(event, TurnFinished):
                self.turns += 1
                self.last_turn = event
            yield event

    # ---- slash commands -------------------------------------------------------------------

    def command(self, command: Any) -> Any:
        """Carry out one slash command; return its type (the loop stops on Quit)."""
        session, display = self.session, self.display
        match command:
            case commands.Help():
                display.table("commands", [(spec.usage, spec.summary) for spec in commands.COMMANDS])
                display.notice('Esc then Enter starts a new line; """ starts a block that """ ends.')
            case commands.Reset():
                session.reset()
                display.notice("conversation and cache cleared")
            case commands.Regen():
                self.turn(session.regenerate())
            case commands.System(text=""):
                display.notice(
                    f"system prompt: {session.system_prompt!r}" if session.system_prompt else "no system prompt"
                )
            case commands.System(text=text):
                self.turn(session.set_system_prompt(text))
                display.notice("system prompt set; the conversation was replayed behind it")
            case commands.Set(key=None):
                display.table("settings", session.options())
            case commands.Set(key=key, value=value):
                session.set_option(key, value)
                display.notice(f"{key} = {dict(session.options())[key]}")
            case commands.Save(path=path):
                target = path or self.new_session_path()
                session.save(target, self.model_name)
                display.notice(f"saved {len(session.transcript)} messages to {target}")
            case commands.Load(path=path):
                self.turn(session.load(path))
            case commands.Stats():
                display.table("session", self.stats_rows())
            case commands.CacheInfo():
                display.table("cache", self.cache_rows())
            case commands.Quit():
                pass
            case _:
                raise CommandError(f"{command!r} is not handled")
        return type(command)

    def stats_rows(self) -> list[tuple[str, str]]:
        stats = self.session.cache_stats()
        figures = status_figures(stats)
        rows = [
            ("model", self.model_name),
            ("turns", f"{self.turns:,}"),
            ("messages", f"{len(self.session.transcript):,}"),
            ("tokens", f"{figures.streamed}, {figures.evicted}"),
            ("cache", figures.occupancy),
            ("seed", str(self.session.sampler.seed)),
        ]
        if self.last_turn is not None:
            rows.append(("last reply", turn_stats_line(self.last_turn.stats)))
        return rows

    def cache_rows(self) -> list[tuple[str, str]]:
        view, stats = self.session.cache_view(), self.session.cache_stats()
        words = self.session.decode(view.window_ids).split()
        forgotten = [f"{view.forgotten_tokens:,} tokens"] if view.forgotten_tokens else ["nothing yet"]
        if view.forgotten_messages:
            whole = view.forgotten_messages
            forgotten.append("message 1 entirely" if whole == 1 else f"messages 1-{whole} entirely")
        if view.partly_forgotten_message is not None:
            forgotten.append(f"the start of message {view.partly_forgotten_message + 1}")
        return [
            ("capacity", f"{stats.capacity:,} = {stats.sink_capacity} sinks + {stats.window_capacity:,} window"),
            ("sinks", repr(self.session.decode(view.sink_ids))),
            ("window starts", " ".join(words[:12]) + (" …" if len(words) > 12 else "")),
            ("window ends", ("… " if len(words) > 12 else "") + " ".join(words[-12:])),
            ("forgotten", "; ".join(forgotten)),
        ]

    def new_session_path(self) -> Path:
        """Where /save without a file, and leaving, save the conversation: a new file each time."""
        return self.sessions_dir / f"session-{datetime.now():%Y%m%d-%H%M%S}.json"

    def goodbye(self) -> None:
        stats = self.session.cache_stats()
        turns = f"{self.turns} turn{'' if self.turns == 1 else 's'}"
        line = f"{turns} · {stats.seen:,} tokens streamed · {stats.evicted:,} evicted"
        if self.session.transcript:
            target = self.new_session_path()
            try:
                self.session.save(target, self.model_name)
                line += f" · saved to {target} (/load it to continue)"
            except StreamchatError as error:
                line += f" · not saved: {error}"
        self.display.notice(line)


@contextmanager
def _keys_not_echoed() -> Iterator[None]:
    """Keys typed while a reply streams wait for the next prompt instead of landing in the reply."""
    try:
        import termios

        descriptor = sys.stdin.fileno()
        saved = termios.tcgetattr(descriptor)
    except (ImportError, OSError, ValueError):  # not a terminal, or not POSIX
        yield
        return
    quiet = list(saved)
    quiet[3] &= ~termios.ECHO
    termios.tcsetattr(descriptor, termios.TCSANOW, quiet)
    try:
        yield
    finally:
        termios.tcsetattr(descriptor, termios.TCSANOW, saved)


@contextmanager
def _stop_on_interrupt(session: ChatSession) -> Iterator[None]:
    """First Ctrl-C: stop the reply after the current token. Second: KeyboardInterrupt."""
    presses = 0

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal presses
        presses += 1
        if presses > 1:
            raise Interrupted
        session.stop()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
