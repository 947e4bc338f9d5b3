"""The interactive chat: read a line, run a turn or a slash command, render, repeat.

The loop drives the engine and hands every event to the display; it renders nothing
itself. Ctrl-C during a reply stops the reply (the session stays consistent); a
second Ctrl-C abandons it, and the cache is rebuilt from the transcript. After every
line, the journal records what changed, so the session file is never behind.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from streamchat import defaults
from streamchat.app import slash_commands as commands
from streamchat.app.repl import Prompter
from streamchat.app.resuming import load_session
from streamchat.app.typeahead import keys_held
from streamchat.conversation.calls import Conversation
from streamchat.conversation.session_options import parse_option
from streamchat.errors import CommandError, RankLostError, StreamchatError
from streamchat.generation.events import Event, StopReason, TurnFinished
from streamchat.interface.display import ChatDisplay, turn_stats_line, turns_text
from streamchat.interface.signals import Interrupted, interrupts_handled, termination_deferred
from streamchat.interface.status import first_words, status_figures
from streamchat.sessions.keeping import save_state
from streamchat.storage.cache_file import StateKey
from streamchat.storage.journal import Journal
from streamchat.storage.session_file import save_session


@dataclass
class ChatApp:
    session: Conversation
    display: ChatDisplay
    prompter: Prompter
    model_name: str
    journal: Journal
    state_key: StateKey | None = None  # None: no cache state is written or restored

    def __post_init__(self) -> None:
        self.turns = 0
        self.last_turn: TurnFinished | None = None
        self._stop_reason: StopReason | None = None  # of a reply the journal has not recorded yet
        self.abandon_on_second_interrupt = True

    def run(self, resume: Path | None = None) -> int:
        """Chat until the user leaves; first go on with the conversation saved at `resume`, if given."""
        # Under --tp a Ctrl-C only ever stops a reply: the second of two quick presses, landing after the reply
        # stopped (while its journal is written, before the prompt is up), must not end the run.
        between_turns = nullcontext() if self.abandon_on_second_interrupt else _interrupts_ignored()
        try:
            with between_turns:
                self._converse(resume)
        finally:
            # However the chat ends (Ctrl-C while the cache is rebuilt, SIGTERM, a bug), say where it is.
            self.goodbye()
        return 0

    def _converse(self, resume: Path | None) -> None:
        if resume is not None:
            self.load(resume)
            self.record()
        while (line := self.prompter.read()) is not None:
            try:
                item = commands.parse_line(line)
                if isinstance(item, commands.ChatText):
                    if item.text.strip():
                        self.journal.record_user(self.session.snapshot(tensors=False), item.text)
                        self.turn(self.session.chat(item.text))
                elif self.command(item) is commands.Quit:
                    break
            except RankLostError:
                raise
            except StreamchatError as error:
                self.display.error(str(error))
            finally:
                # Whatever the line did to the conversation goes to its session file now.
                self.record()

    def record(self) -> None:
        self.journal.record(self.session.snapshot(tensors=False), self._stop_reason)
        self._stop_reason = None

    def turn(self, events: Iterator[Event]) -> None:
        try:
            stopping = _stop_on_interrupt(self.session, self.abandon_on_second_interrupt)
            with termination_deferred(self.session.stop), stopping, keys_held():
                self.display.show(self._counted(events))
        except KeyboardInterrupt:
            self.display.notice("reply abandoned; rebuilding the cache from the transcript")
            self.display.show(self.session.recover())
        except RankLostError:
            raise  # under --tp, the ranks are out of step: the run ends
        except StreamchatError as error:
            # A turn that failed half way (out of memory, say) must not leave the cache torn.
            self.display.error(str(error))
            self.display.show(self.session.recover())

    def _counted(self, events: Iterator[Event]) -> Iterator[Event]:
        for event in events:
            if isinstance(event, TurnFinished):
                self.turns += 1
                self.last_turn = event
                self._stop_reason = event.stats.stop_reason
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
                self.journal.new_conversation()
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
            case commands.Set(key=str(key), value=str(value)):  # the parser gives a key its value
                session.update_settings(**parse_option(key, value))  # the text typed, parsed once
                shown = dict(session.options())  # recall is not among them: session files do not keep it
                display.notice(f"{key} = {shown.get(key, value)}")
            case commands.Save(path=None):
                self.record()
                where = self.journal.path
                if where is None:
                    display.notice("nothing to save yet")
                else:
                    state = save_state(session, where, self.state_key)
                    display.notice(f"the conversation is saved as it goes, in {where}{_state_words(state)}")
            case commands.Save(path=Path() as path):
                save_session(path, session.snapshot(tensors=False), self.model_name)
                state = save_state(session, path, self.state_key)
                display.notice(f"saved {len(session.transcript)} messages to {path}{_state_words(state)}")
            case commands.Load(path=path):
                self.load(path)
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
            ("seed", str(self.session.seed)),
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
        rows = [
            ("capacity", f"{stats.capacity:,} = {stats.sink_capacity} sinks + {stats.window_capacity:,} window"),
            ("kept", _kept_description(self.session.keep, stats.sink_capacity)),
            ("sinks", repr(self.session.decode(view.sink_ids))),
            ("window starts", " ".join(words[:12]) + (" …" if len(words) > 12 else "")),
            ("window ends", ("… " if len(words) > 12 else "") + " ".join(words[-12:])),
            ("forgotten", "; ".join(forgotten)),
        ]
        recalled = self.session.snapshot(tensors=False).recalled
        if recalled:
            # Turn numbers, as the ↺ line gives them: message 6 is turn 4's question.
            at = max(recalled)
            sources = sorted({message // 2 + 1 for message in recalled[at].messages})
            count = len(recalled[at].messages)
            notes = "1 note" if len(recalled) == 1 else f"{len(recalled)} notes"
            last = f"{count} passage{'' if count == 1 else 's'} from {turns_text(sources)}"
            rows.append(("recalled", f"{notes}; the last, with turn {at // 2 + 1}: {last}"))
        return rows

    def load(self, path: Path) -> None:
        """Replace the conversation with a saved one, exactly where it stopped when its cache state fits,
        else replayed; a journal is resumed, so the conversation goes on in it."""
        events, saved = load_session(self.session, self.journal, path, self.state_key)
        self.turn(events)
        if saved.unanswered is not None:
            self.display.notice(
                "the last message in that session never got its reply (the session ended first), so it was "
                f"left out: {first_words(' '.join(saved.unanswered.split()), 80)}"
            )

    def goodbye(self) -> None:
        try:
            # However the chat ends, the next run can go on exactly from here.
            save_state(self.session, self.journal.path if self.journal.failure is None else None, self.state_key)
        except StreamchatError as error:
            with suppress(OSError):
                self.display.error(str(error))
        self.journal.close()
        stats = self.session.cache_stats()
        turns = f"{self.turns} turn{'' if self.turns == 1 else 's'}"
        line = f"{turns} · {stats.seen:,} tokens streamed · {stats.evicted:,} evicted"
        if self.journal.failure is not None:
            line += f" · {self.journal.failure}"
        elif self.journal.path is not None:
            line += f" · saved to {self.journal.path} (streamchat run --continue goes on with it)"
        # After SIGHUP the terminal may be gone: the session file is written, and that is what matters.
        with suppress(OSError):
            self.display.notice(line)


def _state_words(size: int | None) -> str:
    return "" if size is None else f", with its cache state ({size / 2**20:,.1f} MiB) beside it"


def _kept_description(keep: str | int, kept: int) -> str:
    if keep == defaults.KEEP_SYSTEM:
        return f"--keep system: the first {kept} tokens (through the system turn, at least {defaults.SINKS}), for ever"
    return f"--keep {keep}: the first {kept} tokens, for ever"


@contextmanager
def _stop_on_interrupt(session: Conversation, abandon: bool = True) -> Iterator[None]:
    """First Ctrl-C: stop the reply after the current token. Second: KeyboardInterrupt, if `abandon`."""
    presses = 0

    def on_interrupt(signum: int, frame: Any) -> None:
        nonlocal presses
        presses += 1
        if presses > 1 and abandon:
            raise Interrupted
        session.stop()

    with interrupts_handled(on_interrupt):
        yield


def _interrupts_ignored() -> AbstractContextManager[None]:
    """Within the block, SIGINT does nothing (a turn's own handler, and the prompt's, still take it in theirs)."""
    return interrupts_handled(lambda signum, frame: None)
