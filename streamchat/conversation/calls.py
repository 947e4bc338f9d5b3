"""What a conversation accepts, declared once: the calls that move it, and what the app reads of it.

`Conversation` is a session as the app drives it (the REPL, the transcript loop, resuming).
ChatSession answers it as it stands; rank 0's LeaderSession under --tp
(streamchat.distributed.leader) subclasses it and implements it call by call.

The calls that move the conversation are declared apart, in `ConversationMoves`, because
each of them is also a value here, a `Move`: `Chat("Hi")`, `Reset()`, ... A move applies
itself to any session, which is how --tp has every rank make the same call: rank 0 sends
the value (pickled), and every rank applies it.

A new call that moves the conversation takes its method in ConversationMoves and its Move
below (this module), ChatSession's method, and LeaderSession's, which a type checker asks
for (and Python too: LeaderSession cannot be built while a call is left abstract).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar, runtime_checkable

from streamchat.cache import CacheStats
from streamchat.conversation.kept_prefix import Keep
from streamchat.conversation.message import Message
from streamchat.conversation.session_options import SessionChanges
from streamchat.conversation.state import ConversationState
from streamchat.generation.cache_view import CacheView
from streamchat.generation.events import Event
from streamchat.generation.settings import GenerationSettings

if TYPE_CHECKING:
    from typing_extensions import Unpack  # in typing from Python 3.11

# What a move's call returns: the events the caller consumes, or None when it is done on return.
Result = TypeVar("Result", covariant=True)


class ConversationMoves(Protocol):
    """The calls that change the conversation: under --tp, every rank makes each of them."""

    @abstractmethod
    def chat(self, text: str) -> Iterator[Event]:
        """Feed a user message and stream the reply."""

    @abstractmethod
    def regenerate(self) -> Iterator[Event]:
        """Take back the last reply and generate another one for the same message."""

    @abstractmethod
    def recover(self) -> Iterator[Event]:
        """After a turn was torn off mid-step, make the conversation whole again."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the conversation."""

    @abstractmethod
    def set_system_prompt(self, text: str | None) -> Iterator[Event]:
        """Use a new system prompt, with the conversation so far replayed behind it."""

    @abstractmethod
    def update_settings(self, **changes: Unpack[SessionChanges]) -> None:
        """Change generation settings, eviction or recall: `update_settings(temperature=0.5)`."""

    @abstractmethod
    def replay(self, messages: list[Message]) -> Iterator[Event]:
        """Start over with `messages`, as if they had been typed and answered."""

    @abstractmethod
    def restore(self, state: ConversationState, not_exact: str | None = None) -> Iterator[Event]:
        """Become the conversation `state` (exactly, or replayed: `not_exact` says why)."""


@runtime_checkable
class Conversation(ConversationMoves, Protocol):
    """A session as the app drives it: the moves, and what it reads between them."""

    @property
    @abstractmethod
    def transcript(self) -> list[Message]:
        """The messages so far, user and assistant alternating."""

    @property
    @abstractmethod
    def system_prompt(self) -> str | None: ...

    @property
    @abstractmethod
    def settings(self) -> GenerationSettings:
        """How replies are generated now."""

    @property
    @abstractmethod
    def seed(self) -> int:
        """The sampler's seed: the one set, or the one drawn when none was."""

    @property
    @abstractmethod
    def keep(self) -> Keep:
        """What the cache keeps as its sinks (--keep)."""

    @property
    @abstractmethod
    def steps_in_lockstep(self) -> bool:
        """Whether other processes take each step with this one (--tp): then no step may be torn off here
        alone, so a second Ctrl-C stops the reply as the first does."""

    @abstractmethod
    def options(self) -> list[tuple[str, str]]:
        """Every setting /set can change, with its value as text."""

    @abstractmethod
    def cache_stats(self) -> CacheStats: ...

    @abstractmethod
    def cache_view(self) -> CacheView: ...

    @abstractmethod
    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str: ...

    @abstractmethod
    def snapshot(self, tensors: bool = True) -> ConversationState:
        """The conversation as a value; with `tensors`, its exact tensors too when they can be taken."""

    @abstractmethod
    def stop(self) -> None:
        """Ask the reply being generated to end after the current token (safe from a signal handler)."""


class Move(ABC, Generic[Result]):
    """One call that moves a conversation, as a value every rank can apply."""

    @abstractmethod
    def apply(self, session: ConversationMoves) -> Result:
        """Make this call of `session`."""


@dataclass(frozen=True)
class Chat(Move[Iterator[Event]]):
    text: str

    def apply(self, session: ConversationMoves) -> Iterator[Event]:
        return session.chat(self.text)


@dataclass(frozen=True)
class Regenerate(Move[Iterator[Event]]):
    def apply(self, session: ConversationMoves) -> Iterator[Event]:
        return session.regenerate()


@dataclass(frozen=True)
class Recover(Move[Iterator[Event]]):
    def apply(self, session: ConversationMoves) -> Iterator[Event]:
        return session.recover()


@dataclass(frozen=True)
class Reset(Move[None]):
    def apply(self, session: ConversationMoves) -> None:
        session.reset()


@dataclass(frozen=True)
class SetSystemPrompt(Move[Iterator[Event]]):
    text: str | None

    def apply(self, session: ConversationMoves) -> Iterator[Event]:
        return session.set_system_prompt(self.text)


@dataclass(frozen=True)
class UpdateSettings(Move[None]):
    changes: SessionChanges  # typed values: --tp sends them pickled, never as text

    def apply(self, session: ConversationMoves) -> None:
        session.update_settings(**self.changes)


@dataclass(frozen=True)
class Replay(Move[Iterator[Event]]):
    messages: list[Message]

    def apply(self, session: ConversationMoves) -> Iterator[Event]:
        return session.replay(self.messages)


@dataclass(frozen=True)
class Restore(Move[Iterator[Event]]):
    state: ConversationState
    not_exact: str | None = None

    def apply(self, session: ConversationMoves) -> Iterator[Event]:
        return session.restore(self.state, self.not_exact)
