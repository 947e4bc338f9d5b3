"""DrivenSession: a ChatSession with the driver that runs its moves, as the app drives a conversation.

    conversation = DrivenSession(session, driver)
    for event in conversation.chat("Hello!"):   # the session's move, run by the process's driver
        ...
    conversation = driven_session(model, tokenizer, options)   # a new session, with a driver of its own engine

A ChatSession's moves are tasks for the process's driver (streamchat.generation.driver): the
server's worker runs many of them at once. The chat, a piped run, every --tp rank and the
benchmarks run one conversation: this is that conversation as the app sees it
(streamchat.conversation.calls: Conversation), each move's events as they come.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from streamchat.cache import CacheStats
from streamchat.conversation.calls import Conversation
from streamchat.conversation.kept_prefix import Keep
from streamchat.conversation.message import Message
from streamchat.conversation.session import ChatSession
from streamchat.conversation.session_options import SessionOptions
from streamchat.conversation.state import ConversationState
from streamchat.engine.engine import Engine
from streamchat.generation.cache_view import CacheView
from streamchat.generation.driver import Driver
from streamchat.generation.events import Event
from streamchat.generation.settings import GenerationSettings

if TYPE_CHECKING:
    from typing_extensions import Unpack  # in typing from Python 3.11

    from streamchat.conversation.session_options import SessionChanges


def driven_session(model: Any, tokenizer: Any, options: SessionOptions | None = None) -> DrivenSession:
    """A new session over `model`, with the driver of a new engine over it: a process's one conversation (a
    benchmark's, a test's)."""
    return DrivenSession(ChatSession(model, tokenizer, options), Driver(Engine(model)))


class DrivenSession(Conversation):
    """A session whose moves `driver` runs as the caller consumes their events."""

    def __init__(self, session: ChatSession, driver: Driver) -> None:
        self.session = session
        self.driver = driver

    # ---- the moves -------------------------------------------------------------------------

    def chat(self, text: str) -> Iterator[Event]:
        return self.driver.run(self.session.chat(text))

    def regenerate(self) -> Iterator[Event]:
        return self.driver.run(self.session.regenerate())

    def recover(self) -> Iterator[Event]:
        return self.driver.run(self.session.recover())

    def reset(self) -> None:
        self.session.reset()

    def set_system_prompt(self, text: str | None) -> Iterator[Event]:
        return self.driver.run(self.session.set_system_prompt(text))

    def update_settings(self, **changes: Unpack[SessionChanges]) -> None:
        self.session.update_settings(**changes)

    def replay(self, messages: list[Message]) -> Iterator[Event]:
        return self.driver.run(self.session.replay(messages))

    def restore(self, state: ConversationState, not_exact: str | None = None) -> Iterator[Event]:
        return self.driver.run(self.session.restore(state, not_exact))

    # ---- what the app reads between them ---------------------------------------------------

    @property
    def transcript(self) -> list[Message]:
        return self.session.transcript

    @property
    def system_prompt(self) -> str | None:
        return self.session.system_prompt

    @property
    def settings(self) -> GenerationSettings:
        return self.session.settings

    @property
    def seed(self) -> int:
        return self.session.seed

    @property
    def keep(self) -> Keep:
        return self.session.keep

    @property
    def steps_in_lockstep(self) -> bool:
        return self.session.steps_in_lockstep

    def options(self) -> list[tuple[str, str]]:
        return self.session.options()

    def cache_stats(self) -> CacheStats:
        return self.session.cache_stats()

    def cache_view(self) -> CacheView:
        return self.session.cache_view()

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return self.session.decode(token_ids)

    def snapshot(self, tensors: bool = True) -> ConversationState:
        return self.session.snapshot(tensors)

    def stop(self) -> None:
        self.session.stop()
