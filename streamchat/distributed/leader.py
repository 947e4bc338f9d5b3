"""Rank 0's session: every call that moves the conversation goes to every rank first.

`LeaderSession` stands in for the ChatSession the app drives (the REPL, the transcript
loop): reading calls pass straight through; a call that changes the conversation is
sent to the other ranks (follower.py), then made here. The events of a turn are driven
to their end even when the app abandons them, with the reply stopped, because the other
ranks run the turn to its end too: a turn torn off on one rank only would leave the
ranks in different collectives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

from streamchat.conversation.session import ChatSession
from streamchat.conversation.state import ConversationState
from streamchat.distributed.lockstep import EXIT, Lockstep, Request, lost_ranks_reported
from streamchat.errors import OutOfMemoryError, RankLostError, StreamchatError
from streamchat.generation.events import Event

# Why a conversation gone on with under --tp is replayed (shown as "not resumed exactly, replayed: ...").
NOT_RESUMED = "no cache state under --tp (each process holds a shard of the cache)"


class LeaderSession:
    """A ChatSession whose conversation moves on every rank at once."""

    # The app asks: a second Ctrl-C must not tear a step off here alone (app/launch.py).
    in_lockstep = True

    def __init__(self, session: ChatSession, lockstep: Lockstep) -> None:
        self._session = session
        self._lockstep = lockstep
        self._closed = False
        # The ranks are out of step (a peer is gone, or this rank failed): nothing more is sent.
        self._broken = False
        # A call was sent and has not finished here: the others are within it, not waiting for a request.
        self._in_step = False

    def __getattr__(self, name: str) -> Any:
        # Reading the session (stats, transcript, settings, stop()) happens on rank 0 alone.
        return getattr(self._session, name)

    # ---- calls that move the conversation --------------------------------------------------

    def chat(self, text: str) -> Iterator[Event]:
        return self._everywhere("chat", text)

    def regenerate(self) -> Iterator[Event]:
        return self._everywhere("regenerate")

    def recover(self) -> Iterator[Event]:
        return self._everywhere("recover")

    def reset(self) -> None:
        self._everywhere("reset")

    def set_system_prompt(self, text: str | None) -> Iterator[Event]:
        return self._everywhere("set_system_prompt", text)

    def set_option(self, key: str, value: str) -> None:
        self._session.set_option(key, value)  # a bad value is refused here, before any rank changes
        self._lockstep.send(Request("set_option", (key, value)))

    def replay(self, messages: list[Any]) -> Iterator[Event]:
        return self._everywhere("replay", messages)

    def restore(self, state: ConversationState, not_exact: str | None = None) -> Iterator[Event]:
        """Send the conversation's text to every rank; always replayed (each rank holds a shard of the cache)."""
        return self._everywhere("restore", dataclasses.replace(state, tensors=None), NOT_RESUMED)

    def snapshot(self, tensors: bool = True) -> ConversationState:
        """The conversation without tensors: rank 0 holds only a shard of the cache; --continue replays."""
        return self._session.snapshot(tensors=False)

    def close(self) -> None:
        """Tell the other ranks to exit: once, and only when they wait for a request (else they end on their own
        when this process exits: a broadcast to a rank that is gone, hung or mid-step could wait for ever)."""
        if not (self._closed or self._broken or self._in_step):
            self._closed = True
            with suppress(RankLostError):
                self._lockstep.send(Request(EXIT))

    # ---- helpers ------------------------------------------------------------------------------

    def _everywhere(self, call: str, *args: Any) -> Any:
        self._in_step = True
        with self._watched():
            self._lockstep.send(Request(call, args))
            result = getattr(self._session, call)(*args)
        if result is None:
            self._in_step = False
            return None
        return self._driven(result)

    def _driven(self, events: Iterator[Event]) -> Iterator[Event]:
        with self._watched():
            for event in events:
                try:
                    yield event
                except GeneratorExit:
                    # Abandoned here (a closed pipe, say): stop the reply, and finish the turn as the others do.
                    self._session.stop()
                    for _ in events:
                        pass
                    self._in_step = False
                    raise
        self._in_step = False

    @contextmanager
    def _watched(self) -> Iterator[None]:
        try:
            with _fatal_failures(self._lockstep.rank):
                yield
        except RankLostError:
            self._broken = True
            raise
        except StreamchatError:
            self._in_step = False  # every rank met it at the same point (a bad command): still in step
            raise


@contextmanager
def _fatal_failures(rank: int) -> Iterator[None]:
    """A failure that leaves this rank out of step with the others ends the run.

    Out of memory on one rank (its forward pass broke off while the others wait in a
    collective) cannot be recovered from as in one process: it becomes RankLostError, with
    out of memory's message and exit code. Deterministic errors (a bad command) pass: every
    rank meets them at the same point.
    """
    try:
        with lost_ranks_reported(rank, "running a step"):
            yield
    except OutOfMemoryError as error:
        lost = RankLostError(f"rank {rank}: {error}; every rank stops")
        lost.exit_code = error.exit_code
        raise lost from None
