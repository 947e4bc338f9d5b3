"""One request's turn, run step by step on the worker: find the conversation, make it live, answer.

    turn = Turn(pool, request, named=None)
    driver.start(turn.run(), hand_on, ended)   # Started, TextDelta..., Finished; the engine requests it waits on

A request naming a conversation (`named`) sends only its new message. Otherwise its
history is looked up (streamchat.serve.matching): a match continues that conversation and
reads only the new message; no match starts a conversation from the history (a replay:
the kept prefix and the last two windows), then answers. `stop()` (any thread) ends the
reply within a step; what was said is kept in the journal as stopped. A turn stopped before
its reply began (its client left while it waited) records nothing.

After each turn the conversation is filed under what its client was told: the whole
reply, or, when the client left mid-reply, only the text it was sent (none for a whole
reply it never received). A client that resends what it has (for a stream cut short, any
start of what it was sent) continues the conversation; a reply it never saw (or the part of
one) is taken back first, by a replay.

A request with tools (and tool_choice other than "none") has the calls read from its reply in the
syntax the model's template teaches (streamchat.serve.apis.tool_calls); "required" or a named tool
holds the reply to that syntax while it is drawn, so it always reads. The transcript, the journal
and the index then hold the reply as its client is told it: the text outside the calls, and the
calls with their ids; a client that sends back the calls and their results continues the
conversation, and only the results are read.
"""

from __future__ import annotations

import itertools
from collections.abc import Generator
from dataclasses import dataclass

from streamchat.cache.ledger import CacheStats
from streamchat.conversation.message import Message, ToolCall
from streamchat.conversation.session import ChatSession
from streamchat.engine.work import Request
from streamchat.errors import ChatTemplateError, ConfigError
from streamchat.generation.constraint import LarkFormat, ReplyFormat
from streamchat.generation.events import Event, PromptSkipped, Recalled, TextDelta, TurnFinished
from streamchat.serve.apis.request import ApiError, ChatRequest
from streamchat.serve.apis.tool_calls import Family, ReadReply, read_tool_calls, tool_call_grammar, tool_family
from streamchat.serve.pool import ConversationPool, HeldConversation, Taken


@dataclass(frozen=True)
class Started:
    """The turn began: the conversation it continues, what its cache holds, and what the client should know."""

    conversation: str
    cache: CacheStats
    warnings: tuple[str, ...] = ()  # a max_tokens clamped, a prompt read only in part
    # How many messages the conversation held before the new one: with its reply, it holds two more (the Responses
    # API names a response by that count, streamchat.serve.apis.response_ids).
    messages: int = 0
    tool_family: Family | None = None  # the syntax tool calls are read from the reply in; None: it is text


@dataclass(frozen=True)
class Finished:
    """The reply is complete (or was stopped) and journaled; the usage of the whole turn."""

    reply: str
    stop_reason: str
    prompt_tokens: int  # the whole conversation rendered, through the new message
    completion_tokens: int
    cached_tokens: int  # of prompt_tokens, those not read for this request
    cache: CacheStats
    stop_string: str | None = None  # the stop string that ended the reply, where one did
    tool_calls: tuple[ToolCall, ...] = ()  # the calls read from the reply, with the ids its client is told
    content: str | None = None  # with calls: the reply's text outside them


# What a turn tells its request: its start, the reply's text (the engine's steps say most of it: its requests'
# events, streamchat.generation.driver), its end.
Item = Started | TextDelta | Finished


class Turn:
    def __init__(self, pool: ConversationPool, request: ChatRequest, named: str | None = None) -> None:
        self.pool = pool
        self.request = request
        self.named = named
        self.stopped = False
        self.told: str | None = None  # when the client left mid-reply: the reply's text it was sent
        self._session: ChatSession | None = None  # the one answering, once the turn has one (heed_stop's)

    def stop(self, told: str | None = None) -> None:
        """End the reply within a step (safe from any thread: the worker reads the flag); `told`: the client
        left, having been sent that much of the reply."""
        self.told = told
        self.stopped = True

    def heed_stop(self) -> None:
        """On the worker, while the turn's request (its prompt read, its reply) goes on in the engine's steps
        without resuming the turn: a stop() asked for reaches it before its next token or chunk is drawn."""
        if self.stopped and self._session is not None:
            self._session.stop()

    def run(self) -> Generator[Item | Request, None, None]:
        if self.stopped:  # its client left (or the server stops) while it was queued
            return
        conversation, history, system, matched = self._conversation()
        try:
            taken = yield from self.pool.take(conversation, history, system, self.request.tools)
        except ChatTemplateError as error:  # the template cannot hold this conversation: its tools, its system prompt
            raise ApiError(400, str(error), param="tools" if self.request.tools else "messages") from None
        if self.stopped:  # the client left (or the server stops) before the reply began: nothing to record
            self.pool.release(conversation)
            return
        try:
            if matched:
                yield from self.pool.rewind(taken, self.request.history)
            finished = yield from self._answer(taken)
        except BaseException:
            self.pool.drop(conversation)
            self.pool.release(conversation)
            raise
        # Free before the client hears that the reply is done: its next request may follow at once.
        self.pool.release(conversation)
        yield finished

    def _conversation(self) -> tuple[HeldConversation, list[Message] | None, str | None, bool]:
        """The conversation to answer in, the history and system prompt that start it (None: it exists), and
        whether it was found by its history."""
        if self.named is not None:
            return self.pool.named(self.named), None, None, False
        system = self.pool.system_for(self.request.system)
        history = self.request.history
        # Its history, or its history and this very message, never answered (the server stopped mid-reply).
        tools = self.request.tools
        found = self.pool.index.find(system, history, tools) or self.pool.index.find(
            system, [*history, self.request.prompt], tools
        )
        if found is not None:
            try:
                conversation = self.pool.named(found)
            except ApiError as error:
                if error.status not in (404, 409):
                    raise  # its journal is gone, or another streamchat holds it: this history starts a new conversation
            else:
                if not conversation.busy:  # busy: another client sent the same history, and gets its own
                    return conversation, None, None, True
        return self.pool.new(), history, system, False

    def _answer(self, taken: Taken) -> Generator[Item | Request, None, Finished]:
        """Answer the request's message in the conversation taken; the Finished item, for run() to yield.
        While its prompt is read and its reply decodes it yields the requests it waits on: the driver hands on the
        reply's text after each step."""
        conversation = taken.conversation
        session = conversation.session
        if session is None:
            raise ApiError(500, "the conversation has no session", kind="server_error")
        self._session = session
        warnings = []
        # What the request leaves out is the server's, not what the conversation's last request set.
        try:
            wanted = self.pool.base_settings.changed(self.request.settings)
        except ConfigError as error:  # each field was checked as it was read; refused all the same, as a 400
            raise ApiError(400, str(error)) from None
        limit = self.pool.served.reply_tokens_limit
        if limit is not None and wanted.max_new_tokens > limit:
            if "max_new_tokens" in self.request.settings:
                warnings.append(
                    f"max_tokens {wanted.max_new_tokens:,} is past the server's limit: clamped to {limit:,}"
                )
            wanted = wanted.changed({"max_new_tokens": limit})
        # Only what differs: a seed the conversation already draws with goes on, as before, rather than restarting.
        session.update_settings(**session.settings.changes_to(wanted))
        family = self._tool_family(session)
        session.reply_format = self._reply_format(family)  # this request's, not the last one's
        try:
            request = self.request
            if request.tool_results is not None:
                items = session.answer_tool_results(request.tool_results, request.logprobs, request.text)
            else:
                items = session.chat(self.request.text, self.request.logprobs)
        except ConfigError as error:
            raise ApiError(400, str(error), param="messages") from None
        state = session.snapshot(tensors=False)
        journal = conversation.journal
        # A new conversation's history and settings, a known one's new settings, and the message: one write.
        journal.record_prompt(state, self.request.prompt)
        if conversation.id is None:
            raise ApiError(500, journal.failure or "the conversation could not be journaled", kind="server_error")
        self.pool.conversations[conversation.id] = conversation  # named by its id from now on, busy or not
        before = session.cache_stats()
        held = len(session.transcript)
        prompt_length = None
        finished = None
        early: list[Event | Request] = []  # before the first forward pass: a note recalled, a prompt read in part
        for item in items:
            early.append(item)
            if not isinstance(item, Recalled | PromptSkipped):
                break
        for event in early:
            if isinstance(event, PromptSkipped):
                warnings.append(
                    f"the message is {event.prompt_tokens:,} tokens, more than the cache holds: "
                    f"{event.read_tokens:,} of them were read (its start and its end)"
                )
        yield Started(conversation.id, before, tuple(warnings), held, family)
        for item in itertools.chain(early, items):
            if self.stopped:
                session.stop()
            if isinstance(item, TextDelta | Request):  # the reply's last text; what it waits on
                yield item
            elif isinstance(item, PromptSkipped):
                prompt_length = item.prompt_tokens
            elif isinstance(item, TurnFinished):
                finished = item
        if finished is None:
            raise ApiError(500, "the reply ended without finishing", kind="server_error")
        stats = finished.stats
        said = ReadReply(finished.reply) if family is None else read_tool_calls(family, finished.reply)
        if said.calls:
            session.settle_tool_calls(said.content, said.calls)
        journal.record(session.snapshot(tensors=False), stats.stop_reason)
        after = session.cache_stats()
        prompt_length = stats.prompt_tokens if prompt_length is None else prompt_length
        prompt_tokens = conversation.rendered_tokens + prompt_length
        conversation.rendered_tokens = prompt_tokens + (after.seen - before.seen - stats.prompt_tokens)
        cut_short = bool(self.told)  # the client left mid-stream, having read some start of what it was sent
        told = self._told(session.transcript)
        self.pool.index.file(conversation.id, session.system_prompt, told, cut_short, session.tools)
        read = taken.restore_read + stats.prompt_tokens - stats.copied_prompt_tokens  # copied sinks were not read
        return Finished(
            reply=finished.reply,
            stop_reason=stats.stop_reason,
            prompt_tokens=prompt_tokens,
            completion_tokens=stats.generated_tokens,
            cached_tokens=max(0, prompt_tokens - read),
            cache=after,
            stop_string=stats.stop_string,
            tool_calls=tuple(said.calls),
            content=said.content if said.calls else None,
        )

    def _tool_family(self, session: ChatSession) -> Family | None:
        """The syntax calls are read from this reply in; None when none are (no tools, or tool_choice "none")."""
        tools = self.request.tools
        if tools is not None and tools != session.tools:  # a conversation named by its id
            raise ApiError(
                400,
                "'tools' are not this conversation's: a conversation's tools are fixed when it starts",
                param="tools",
            )
        if tools is None or self.request.tool_choice == "none":
            return None
        family = tool_family(session.chat_format.template)
        if family is None:
            raise ApiError(
                400,
                "the model's chat template describes tools, but not in a syntax streamchat reads calls in "
                '(Hermes/Qwen <tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS]); use tool_choice "none"',
                param="tools",
            )
        return family

    def _reply_format(self, family: Family | None) -> ReplyFormat | None:
        """What the reply is held to: the request's JSON schema, or, where it must call a tool, the call's syntax."""
        choice = self.request.tool_choice
        if family is None or self.request.tools is None or choice in ("none", "auto"):
            return self.request.json_format
        name = None if choice == "required" else choice
        try:
            return LarkFormat(tool_call_grammar(family, self.request.tools, name, self.request.parallel_tool_calls))
        except ConfigError as error:
            raise ApiError(400, f"'tools': a call's parameters cannot hold a reply: {error}", param="tools") from None

    def _told(self, transcript: list[Message]) -> list[Message]:
        """The conversation as the client knows it: `transcript`, less what it was not sent of the last reply."""
        if self.told is None or not transcript or transcript[-1]["role"] != "assistant":
            return transcript
        told: list[Message] = [{"role": "assistant", "content": self.told}] if self.told else []
        return [*transcript[:-2], *(transcript[-2:-1] if told else []), *told]
