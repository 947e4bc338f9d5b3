"""The server's conversations: a few live (each with its own cache), the rest parked on disk.

Every conversation is a journal in the same sessions directory as `streamchat run`'s, so
`streamchat sessions` lists it and `run --resume ID` continues it; a session `run` saved
is continued here the same way (its journal claimed, its cache state restored when it fits).

At most `max_live` conversations hold a ChatSession (a cache) at once. Past that, the least
recently used idle one is parked: its exact state is written beside its journal and its
session handed to the next conversation, and its journal let go; a request for it later opens
the journal again and restores that state, exactly, without a replay. Only the worker thread
(streamchat.serve.worker) touches the pool.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamchat import defaults
from streamchat.conversation.message import Message
from streamchat.conversation.state import ConversationState
from streamchat.engine.shared_sinks import SharedSinks
from streamchat.engine.work import Request
from streamchat.errors import SessionFileError, out_of_memory_as
from streamchat.generation.driver import Driver
from streamchat.generation.events import NotResumed, Replayed
from streamchat.generation.settings import GenerationSettings
from streamchat.serve.apis.request import ApiError
from streamchat.serve.matching import ConversationIndex, is_session_id
from streamchat.sessions.keeping import save_state, state_to_restore
from streamchat.storage.journal import SUFFIX, Journal, claim_journal
from streamchat.storage.session_file import JOURNAL_VERSION, read_session

if TYPE_CHECKING:
    from streamchat.conversation.session import ChatSession
    from streamchat.storage.cache_file import StateKey

log = logging.getLogger("streamchat.serve")

# The header a request names its conversation with (streamchat.serve.http reads it).
NAMING_HEADER = "X-Streamchat-Conversation"  # also on every reply: the conversation it continued


class NoSessionFree(ApiError):
    """Every live conversation is answering: a turn that needs a session of its own waits in line for a turn to end
    (the worker starts it again then); a 503 where it reaches a client."""

    def __init__(self) -> None:
        super().__init__(503, "every conversation is answering; try again shortly", kind="server_error", code="busy")


@dataclass(frozen=True)
class Served:
    """What the server serves: one loaded model, the sessions built over it, where conversations live."""

    name: str  # the model, as /v1/models lists it
    new_session: Callable[[], ChatSession]  # a session over the one loaded model, as the run's options ask (sharing
    # `shared_sinks`)
    key: StateKey | None  # what this run's cache states are valid for; None: none written or read
    sessions: Path  # the journals' directory (data_dir()/sessions)
    cache_layout: dict[str, str | int]  # keep and window, for each journal's header
    driver: Driver  # the worker's: every session's forward passes run together in its engine's steps
    shared_sinks: SharedSinks  # the sinks new conversations that begin alike copy, read once
    reply_tokens_limit: int | None = None  # the most tokens any reply may have, whatever a request asks
    meta: dict[str, str | int] = field(default_factory=dict)  # what /v1/models says beyond the name (llama.cpp's
    # "meta"): the KV cache's format, window and bytes a token


@dataclass
class HeldConversation:
    """One conversation the server has opened: its journal, and its session while it is live."""

    journal: Journal
    session: ChatSession | None = None  # None: parked (its state beside its journal) or not yet restored
    rendered_tokens: int = 0  # its whole history in the chat format, read or not
    busy: bool = False  # a request is being answered
    last_used: int = 0

    @property
    def id(self) -> str | None:
        return None if self.journal.path is None else self.journal.path.stem


@dataclass
class Taken:
    """A conversation ready for a request's turn: live, busy, and what restoring it read."""

    conversation: HeldConversation
    restore_read: int = 0  # tokens read to make it live again (a replay), 0 when it was live or exact


@dataclass
class ConversationPool:
    served: Served
    max_live: int
    index: ConversationIndex = field(default_factory=ConversationIndex)
    conversations: dict[str, HeldConversation] = field(default_factory=dict)
    _free: list[ChatSession] = field(default_factory=list)
    _lengths: dict[str, int] = field(default_factory=dict)  # parked conversations' rendered_tokens
    _clock: itertools.count = field(default_factory=itertools.count)
    # A new conversation's generation settings (a request's start from them) and eviction, set by start().
    base_settings: GenerationSettings = field(default_factory=GenerationSettings)
    base_eviction: str = defaults.EVICTION_POLICY
    default_system: str | None = None

    def start(self) -> None:
        """Build the sessions (the server's settings and system prompt come from the first), warm up, and file every
        journal already in the sessions directory, so that a request resending one continues it (one that ends
        on a message never answered, a crash mid-reply, is filed with that message: a request that sends it
        again continues the conversation, the message resent taking its place; one that ends on a reply that was
        stopped, as cut short: its client may have read any start of it)."""
        session = self.served.new_session()
        self._warm_up(session)
        # Every live conversation's session built now (a few milliseconds each, the chat format's checks), not
        # while the first requests that come together wait for the worker to build them one by one.
        self._free = [session, *(self.served.new_session() for _ in range(self.max_live - 1))]
        self.base_settings, self.base_eviction = session.settings, session.eviction
        self.default_system = session.system_prompt
        for path in sorted(self.served.sessions.glob(f"*{SUFFIX}")) if self.served.sessions.is_dir() else []:
            try:
                saved = read_session(path)
            except (SessionFileError, OSError):
                continue
            if saved.version == JOURNAL_VERSION:
                unanswered: list[Message] = (
                    [] if saved.unanswered is None else [{"role": "user", "content": saved.unanswered}]
                )
                said = [*saved.messages, *unanswered]
                self.index.file(path.stem, saved.system_prompt, said, saved.last_reply_stopped, saved.tools)

    def system_for(self, requested: str | None) -> str | None:
        return requested if requested is not None else self.default_system

    # ---- taking a conversation for a turn ---------------------------------------------------------

    def named(self, conversation_id: str) -> HeldConversation:
        """The conversation `conversation_id`, opened from its journal if this server has not yet; 404, 409."""
        known = self.conversations.get(conversation_id)
        if known is not None:
            return known
        path = self.served.sessions / f"{conversation_id}{SUFFIX}"
        if not is_session_id(conversation_id) or not path.is_file():
            raise ApiError(404, f"no conversation {conversation_id!r}", param=NAMING_HEADER, code="not_found")
        try:
            saved = read_session(path)
            descriptor = claim_journal(path)
        except SessionFileError as error:
            raise ApiError(409, str(error), code="conversation_unavailable") from None
        journal = self._journal()
        journal.resume(path, saved, descriptor)
        conversation = HeldConversation(journal, rendered_tokens=self._lengths.pop(conversation_id, 0))
        self.conversations[conversation_id] = conversation
        return conversation

    def new(self) -> HeldConversation:
        """A conversation without a journal file yet (it appears with the first message recorded)."""
        return HeldConversation(self._journal())

    def take(
        self,
        conversation: HeldConversation,
        history: list[Message] | None,
        system: str | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Generator[Request, None, Taken]:
        """Make `conversation` live for a turn: `history`, `system` and `tools` start a new one (replayed); a known
        one is restored from its state beside its journal (else replayed). 409 when another request holds it."""
        if conversation.busy:
            raise ApiError(409, "another request is answering in this conversation", code="conversation_busy")
        conversation.busy = True
        try:
            if conversation.session is None:
                session = self._session()
                conversation.session = session
                read = yield from self._restore(conversation, session, history, system, tools)
            else:
                read = 0
        except BaseException:
            self.release(conversation)
            raise
        conversation.last_used = next(self._clock)
        return Taken(conversation, read)

    def release(self, conversation: HeldConversation) -> None:
        conversation.busy = False
        conversation.last_used = next(self._clock)
        if conversation.id is not None:
            self.conversations[conversation.id] = conversation
        elif conversation.session is not None:  # never recorded: nothing to keep
            self._free.append(conversation.session)
            conversation.session = None

    def rewind(self, taken: Taken, history: list[Message]) -> Generator[Request, None, None]:
        """Make the conversation `taken` what its client resent, `history`: the same, or less than it says when
        the client left before it was sent a reply (or the end of one), which is then taken back by a replay."""
        session = taken.conversation.session
        if session is None or session.transcript == history:
            return
        state = session.snapshot(tensors=False)
        recalled = {index: note for index, note in state.recalled.items() if index < len(history)}
        told = replace(state, messages=list(history), recalled=recalled)
        for item in session.restore(told):
            if isinstance(item, Replayed):
                taken.restore_read += item.tokens - item.copied  # copied sinks were not read
            elif isinstance(item, Request):
                yield item
        feeds = session.chat_format.conversation_ids(session.transcript)
        taken.conversation.rendered_tokens = sum(len(ids) for ids in feeds)

    # ---- parking -------------------------------------------------------------------------------------

    def park(self, conversation: HeldConversation) -> None:
        """Write `conversation`'s exact state beside its journal, give its session back and let go of its
        journal (a parked conversation holds no file open: `run --resume` may take it meanwhile)."""
        session = conversation.session
        path = conversation.journal.path
        if session is not None:
            try:
                save_state(session, path, self.served.key)
            except SessionFileError as error:
                log.warning("%s; it will be replayed", error)
        if session is not None:
            conversation.session = None
            self._free.append(session)
        conversation.journal.close()
        if conversation.id is not None:
            self.conversations.pop(conversation.id, None)
            self._lengths[conversation.id] = conversation.rendered_tokens

    def drop(self, conversation: HeldConversation) -> None:
        """A turn failed half way: the session's cache may be torn, so it is emptied and given back; the
        conversation is read again from its journal when next asked for."""
        session = conversation.session
        if session is not None:
            session.reset()
            conversation.session = None
            conversation.rendered_tokens = 0
            self._free.append(session)

    def park_all(self) -> None:
        """Every live conversation's state written (the server is stopping), every journal closed."""
        for conversation in list(self.conversations.values()):
            self.park(conversation)

    def is_parked(self, conversation_id: str) -> bool:
        return conversation_id in self._lengths

    def _session(self) -> ChatSession:
        """A free session, the least recently used idle conversation's parked for it if none is; NoSessionFree when
        every live conversation is answering."""
        if not self._free:
            idle = [c for c in self.conversations.values() if c.session is not None and not c.busy]
            if not idle:
                raise NoSessionFree()
            self.park(min(idle, key=lambda c: c.last_used))
        return self._free.pop()

    def _warm_up(self, session: ChatSession) -> None:
        """Before the first request, in the first session: the sinks of the default system turn read and kept for
        new conversations to copy, and the decode pool grown for every live conversation. The first requests to
        come together wait for neither, and memory too short for them fails the start, not a request."""
        short = (
            f"out of memory on {session.device} making room for {self.max_live} conversations; try a smaller "
            "--max-conversations, a smaller --window, or a smaller model"
        )
        driver = self.served.driver
        with out_of_memory_as(short):
            for _ in driver.run(session.share_sinks()):
                pass
            if session.cache.ledger.sinks_full:
                driver.engine.reserve(self.max_live, session.cache)
        session.reset()

    def _restore(
        self,
        conversation: HeldConversation,
        session: ChatSession,
        history: list[Message] | None,
        system: str | None,
        tools: list[dict[str, Any]] | None,
    ) -> Generator[Request, None, int]:
        path = conversation.journal.path
        if path is None:
            state = ConversationState(list(history or []), system, self.base_settings, self.base_eviction, tools=tools)
            items = session.restore(state)
        else:
            items = session.restore(*state_to_restore(read_session(path), path, self.served.key, session.settings))
        read = 0
        for item in items:
            if isinstance(item, Replayed):
                read = item.tokens - item.copied  # copied sinks were not read
            elif isinstance(item, NotResumed):
                log.info("conversation %s replayed: %s", conversation.id, item.reason)
            elif isinstance(item, Request):
                yield item
        if not conversation.rendered_tokens:  # a parked conversation's length was kept; a new or saved one is counted
            feeds = session.chat_format.conversation_ids(session.transcript)
            conversation.rendered_tokens = sum(len(ids) for ids in feeds)
        return read

    def _journal(self) -> Journal:
        def report(problem: str) -> None:
            log.warning("%s", problem)

        return Journal(self.served.sessions, self.served.name, dict(self.served.cache_layout), report)
