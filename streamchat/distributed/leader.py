"""Rank 0's session: every call that moves the conversation goes to every rank first.

`LeaderSession` is the Conversation the app drives (the REPL, the transcript loop) under
--tp, around rank 0's ChatSession and driver: each read is answered here, from rank 0's session; each
call that moves the conversation is sent to the other ranks as a Move (follower.py), then
made here. The events of a turn are driven to their end even when the app abandons them,
with the reply stopped, because the other ranks run the turn to its end too: a turn torn
off on one rank only would leave the ranks in different collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import TYPE_CHECKING, TypeVar

from streamchat.conversation.calls import (
    Chat,
    Move,
    Recover,
    Regenerate,
    Replay,
    Reset,
    Restore,
    SetSystemPrompt,
    UpdateSettings,
)
from streamchat.conversation.driven import DrivenSession
from streamchat.conversation.message import Message
from streamchat.conversation.session import ChatSession
from streamchat.conversation.state import ConversationState
from streamchat.distributed.lockstep import Exit, Lockstep, out_of_step_failures
from streamchat.errors import RankLostError, StreamchatError
from streamchat.generation.driver import Driver
from streamchat.generation.events import Event

if TYPE_CHECKING:
    from typing_extensions import Unpack  # in typing from Python 3.11

    from streamchat.conversation.session_options import SessionChanges

# Why a conversation gone on with under --tp is replayed (shown as "not resumed exactly, replayed: ...").
NOT_RESUMED = "no cache state under --tp (each process holds a shard of the cache)"

Result = TypeVar("Result")


class LeaderSession(DrivenSession):
    """A Conversation that moves on every rank at once."""

    def __init__(self, session: ChatSession, driver: Driver, lockstep: Lockstep) -> None:
        super().__init__(session, driver)
        self._here = DrivenSession(session, driver)  # rank 0's own moves, once the others were told
        self._lockstep = lockstep
        self._closed = False
        # The ranks are out of step (a peer is gone, or this rank failed): nothing more is sent.
        self._broken = False
        # A call was sent and has not finished here: the others are within it, not waiting for a request.
        self._in_step = False

    # ---- reading the conversation: rank 0 alone (DrivenSession's reads) -------------------------

    @property
    def steps_in_lockstep(self) -> bool:
        return True

    def snapshot(self, tensors: bool = True) -> ConversationState:
        """The conversation without tensors: rank 0 holds only a shard of the cache; --continue replays."""
        return self.session.snapshot(tensors=False)

    # ---- calls that move the conversation: every rank ----------------------------------------

    def chat(self, text: str) -> Iterator[Event]:
        return self._turn_everywhere(Chat(text))

    def regenerate(self) -> Iterator[Event]:
        return self._turn_everywhere(Regenerate())

    def recover(self) -> Iterator[Event]:
        return self._turn_everywhere(Recover())

    def reset(self) -> None:
        self._everywhere(Reset())
        self._in_step = False

    def set_system_prompt(self, text: str | None) -> Iterator[Event]:
        return self._turn_everywhere(SetSystemPrompt(text))

    def update_settings(self, **changes: Unpack[SessionChanges]) -> None:
        self.session.update_settings(**changes)  # a bad value is refused here, before any rank changes
        self._lockstep.send(UpdateSettings(changes))

    def replay(self, messages: list[Message]) -> Iterator[Event]:
        return self._turn_everywhere(Replay(messages))

    def restore(self, state: ConversationState, not_exact: str | None = None) -> Iterator[Event]:
        """Send the conversation's text to every rank; always replayed (each rank holds a shard of the cache)."""
        return self._turn_everywhere(Restore(dataclasses.replace(state, tensors=None), NOT_RESUMED))

    def close(self) -> None:
        """Tell the other ranks to exit: once, and only when they wait for a request (else they end on their own
        when this process exits: a broadcast to a rank that is gone, hung or mid-step could wait for ever)."""
        if not (self._closed or self._broken or self._in_step):
            self._closed = True
            with suppress(RankLostError):
                self._lockstep.send(Exit())

    # ---- helpers ------------------------------------------------------------------------------

    def _everywhere(self, move: Move[Result]) -> Result:
        """Send `move` to the other ranks, then make it here; they are within it until it ends here too."""
        self._in_step = True
        with self._watched():
            self._lockstep.send(move)
            return move.apply(self._here)

    def _turn_everywhere(self, move: Move[Iterator[Event]]) -> Iterator[Event]:
        return self._driven(self._everywhere(move))

    def _driven(self, events: Iterator[Event]) -> Iterator[Event]:
        with self._watched():
            for event in events:
                try:
                    yield event
                except GeneratorExit:
                    # Abandoned here (a closed pipe, say): stop the reply, and finish the turn as the others do.
                    self.session.stop()
                    for _ in events:
                        pass
                    self._in_step = False
                    raise
        self._in_step = False

    @contextmanager
    def _watched(self) -> Iterator[None]:
        try:
            with out_of_step_failures(self._lockstep.rank, "running a step", "; every rank stops"):
                yield
        except RankLostError:
            self._broken = True
            raise
        except StreamchatError:
            self._in_step = False  # every rank met it at the same point (a bad command): still in step
            raise
