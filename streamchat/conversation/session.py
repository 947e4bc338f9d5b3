"""ChatSession: one model, one tokenizer, one sink cache and one transcript, for as long as the chat lasts.

Each call that moves the conversation (chat, regenerate, replay) returns a task: a generator of the events it says
and the engine requests it waits on, which the process's driver runs (streamchat.generation.driver); the
conversation advances as the driver moves it. Every token is fed exactly once, in conversation order: the cache is
never recomputed, only reset when asked.

The session keeps the conversation: the transcript, the chat format, the settings, what /regen goes back to.
Its tokens go through the cache in a TokenLoop (streamchat.generation.token_loop): prompts prefilled, replies decoded.

A conversation is a value: `snapshot()` gives all of it as data (a ConversationState:
messages, settings, system prompt and, between turns, the exact tensors of its cache
and sampler), and `restore(state)` makes a session that conversation again. The
session touches no file: whoever owns it (the app, a server) hands those values to streamchat.storage.

The calls the app makes of a conversation are declared in streamchat.conversation.calls
(`Conversation`), which a session answers with the driver that runs its moves
(streamchat.conversation.driven: DrivenSession). A reply may call tools (a server reads them from its text:
settle_tool_calls); answer_tool_results feeds their results as chat() feeds a user message.

    session = ChatSession(model, tokenizer, SessionOptions())
    driver = Driver(Engine(model))
    for event in driver.run(session.chat("Hello!")):
        ...  # TextDelta, Evicted, CacheOccupancy, ..., TurnFinished
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch

from streamchat import defaults
from streamchat.cache import CacheStats, SinkCache
from streamchat.cache.snapshots import release_snapshots
from streamchat.conversation.kept_prefix import kept_tokens
from streamchat.conversation.message import Message, ToolCall, ToolResult, is_prompt, tool_results_message
from streamchat.conversation.recall import (
    Passage,
    RecallIndex,
    fed_ids,
    fed_text,
    note_budget,
    recall_note,
    recalled_event,
)
from streamchat.conversation.session_options import (
    SessionChanges,
    SessionOptions,
    eviction_policy,
    generation_changes,
    recall_mode,
)
from streamchat.conversation.state import ConversationState, RecalledNote
from streamchat.conversation.template import ChatFormat, chat_format_for, stop_token_ids
from streamchat.conversation.tensors import restore_tensors, tensors_of
from streamchat.engine.work import Request
from streamchat.errors import CacheStateError, ConfigError
from streamchat.generation.cache_view import CacheView
from streamchat.generation.decoder import LockstepChannel
from streamchat.generation.driver import Abandoned
from streamchat.generation.events import CacheOccupancy, Event, NotResumed, Replayed, Resumed, TextDelta, TurnFinished
from streamchat.generation.requests import Reply
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.generation.token_loop import RegenPoint, TokenLoop

if TYPE_CHECKING:
    from typing_extensions import Unpack  # in typing from Python 3.11

# A call that moves the conversation, as the driver runs it: the events it says, the engine requests it waits on.
SessionTask = Generator[Event | Request, None, None]


class ChatSession:
    def __init__(self, model: Any, tokenizer: Any, options: SessionOptions | None = None) -> None:
        options = options or SessionOptions()
        self.model = model
        self.tokenizer = tokenizer
        self.eviction = options.eviction
        self.read_all = options.read_all
        self.reply_format = options.reply_format  # what every reply must be (a JSON schema, a tool call), if held
        self.regenerates = options.regenerates
        self.settings = options.settings or GenerationSettings.from_generation_config(
            getattr(model, "generation_config", None)
        )
        self.sampler = Sampler(self.settings.seed)
        self.keep, self.window = options.keep, options.window
        self.token_loop = TokenLoop(
            model, tokenizer, options.window, options.prefill_chunk, options.channel, options.shared_sinks
        )
        self.transcript: list[Message] = []
        # --recall: "auto" brings back what left the cache when a message needs it; the notes it read, by message.
        self.recall = recall_mode(options.recall)
        self.recalled: dict[int, RecalledNote] = {}
        self._recall_index = RecallIndex()
        # The cache holds exactly the transcript: no turn, replay or resume is half done.
        self._settled = True
        self._snapshot: RegenPoint | None = None
        self._conversation = 0  # counts resets: a reply abandoned before one must not close after it
        self._use_format(chat_format_for(tokenizer, options.system_prompt))

    # ---- reading the session --------------------------------------------------------------

    @property
    def system_prompt(self) -> str | None:
        return self.chat_format.system_prompt

    @property
    def tools(self) -> list[dict[str, Any]] | None:  # what the first turn describes, fixed when it starts
        return self.chat_format.tools

    @property
    def seed(self) -> int:
        """The sampler's seed: the one set, or the one drawn when none was."""
        return self.sampler.seed

    @property
    def steps_in_lockstep(self) -> bool:
        """Whether other processes take each step with this one (a channel: --tp)."""
        return self.channel is not None

    # The token loop owns the cache and its companions; the app, the ranks and the tests read them here.

    @property
    def cache(self) -> SinkCache:
        return self.token_loop.cache

    @property
    def device(self) -> torch.device:
        return self.token_loop.device

    @property
    def channel(self) -> LockstepChannel | None:
        return self.token_loop.channel

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    def cache_view(self) -> CacheView:
        return CacheView.of(self.cache.held_tokens())

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    # ---- moving the conversation ----------------------------------------------------------

    def chat(self, text: str, logprobs: int | None = None) -> SessionTask:
        """Feed a user message and stream the reply (with `logprobs`, each token's log-probability and that many of
        the likeliest alternatives' too: TokenLogprob events). A prompt longer than the cache holds is read as a
        replay reads a conversation (streamchat.generation.requests) unless read_all; a stop() while it is
        read ends the reading between two forward passes, and the reply before it starts."""
        return self._answer({"role": "user", "content": text}, logprobs)

    def answer_tool_results(
        self, results: list[ToolResult], logprobs: int | None = None, text: str = ""
    ) -> SessionTask:
        """Feed the results of the last reply's calls, then `text` (the user's words, if any): one reply, as chat()."""
        if not self.transcript or not self.transcript[-1].get("tool_calls"):
            raise ConfigError("tool results answer a reply that called tools: the last reply called none")
        return self._answer(tool_results_message(results, text), logprobs)

    def settle_tool_calls(self, content: str, calls: list[ToolCall]) -> None:
        """The last reply as its tool calls were read from it: what the transcript (a journal, a replay) holds; the
        cache keeps the tokens the model wrote."""
        if self.transcript and self.transcript[-1]["role"] == "assistant":
            self.transcript[-1] = {"role": "assistant", "content": content, "tool_calls": calls}

    def _answer(self, message: Message, logprobs: int | None) -> SessionTask:
        self.token_loop.stop_requested = self._settled = False
        self._forget_snapshot()
        started = time.perf_counter()
        if message["role"] == "tool":  # the results of the last reply's calls: no recall note
            prompt, note = self.chat_format.tool_results_ids(self.transcript[-1], message), None
        else:
            prompt, note = self.next_prompt(message["content"])
        self.transcript.append(message)
        if note is not None:
            self.recalled[len(self.transcript) - 1] = note
            yield recalled_event(self.chat_format, message["content"], note)
        reply_room = self._reply_reach() if self.eviction == "turn" else None
        read = yield from self.token_loop.prefill(prompt, len(self.transcript) - 1, self.read_all, reply_room)
        # /regen answers the same prompt again: not one that was read only in part.
        regen = read.whole and self.regenerates
        self._snapshot = RegenPoint.take(self.token_loop, self._reply_reach(), read.logits) if regen else None
        yield from self._reply(read.logits, read.tokens, started, read.at, read.copied, logprobs)

    def share_sinks(self) -> SessionTask:
        """Before any turn: the sinks every first turn begins with (the system turn, by default) read for the
        conversations sharing its engine to copy (a server warming up); the cache holds them until reset()."""
        ids = self.chat_format.common_start(self.cache.sinks)
        if ids and not self.transcript:
            yield from self.token_loop.share_sinks(ids, message=0)

    def regenerate(self) -> SessionTask:
        """Take back the last reply and generate another one for the same message."""
        if self._snapshot is None or not self.transcript or self.transcript[-1]["role"] != "assistant":
            raise ConfigError("there is no reply to regenerate yet")
        self.transcript.pop()
        self.token_loop.stop_requested = self._settled = False
        started = time.perf_counter()
        logits = self._snapshot.restore(self.token_loop)
        # The settings, and so the reply's reach, may have changed.
        self._snapshot = RegenPoint.take(self.token_loop, self._reply_reach(), logits)
        yield CacheOccupancy(self.cache_stats(), 0.0)
        yield from self._reply(logits, 0, started, started)

    def recover(self) -> SessionTask:
        """After a turn was torn off mid-step (a second Ctrl-C), make the session whole again.

        A cache that missed part of a forward pass is rebuilt from the transcript. A turn
        without a reply is dropped: a reply must follow a prompt in the cache.
        """
        messages = list(self.transcript)
        if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
            messages.pop()
        if messages and is_prompt(messages[-1]):
            messages.pop()
        if messages == self.transcript and self.token_loop.is_whole():
            return
        recalled = {index: note for index, note in self.recalled.items() if index < len(messages)}
        yield from self._replay(messages, fed_ids(self.chat_format, messages, recalled), recalled)

    def stop(self) -> None:
        """Ask the reply being generated to end after the current token (safe from a signal handler)."""
        self.token_loop.stop_requested = True

    def reset(self) -> None:
        """Forget the conversation: an empty cache and an empty transcript."""
        self._conversation += 1
        self._forget_snapshot()
        self.token_loop.reset()
        self.transcript = []
        self.recalled = {}
        self._recall_index = RecallIndex()
        self._settled = True

    def set_system_prompt(self, text: str | None) -> SessionTask:
        """Use a new system prompt: the conversation so far is replayed behind it (in a new cache when the
        kept prefix changes length); ConfigError, and nothing changes, when it is too long to keep."""
        chat_format = chat_format_for(self.tokenizer, text or None, self.tools)
        recalled = dict(self.recalled)
        feeds = fed_ids(chat_format, self.transcript, recalled)
        self._use_format(chat_format)
        return self._replay(list(self.transcript), feeds, recalled)

    def update_settings(self, **changes: Unpack[SessionChanges]) -> None:
        """Change generation settings, `eviction` or `recall` (`update_settings(temperature=0.5)`); ConfigError,
        and nothing changes, when a value is wrong. A seed given starts the sampler again, even the same seed."""
        settings = self.settings.changed(generation_changes(changes))
        eviction = eviction_policy(changes.get("eviction", self.eviction))
        recall = recall_mode(changes.get("recall", self.recall))
        self.settings, self.eviction, self.recall = settings, eviction, recall
        if "seed" in changes:
            self.sampler = Sampler(settings.seed)

    def options(self) -> list[tuple[str, str]]:
        """Every setting /set can change, with its value as text."""
        return [*self.settings.as_pairs(), ("eviction", self.eviction)]

    def replay(self, messages: list[Message]) -> SessionTask:
        """Start over and feed a conversation through the cache, as if it had been typed and answered."""
        return self._replay(messages, self.chat_format.conversation_ids(messages))

    def snapshot(self, tensors: bool = True) -> ConversationState:
        """The conversation as a value; with `tensors`, its exact tensors too when the cache holds it whole
        (between turns: not mid-reply, not torn off half way)."""
        whole = tensors and len(self.transcript) % 2 == 0 and self._settled and self.token_loop.is_whole()
        return ConversationState(
            messages=[message.copy() for message in self.transcript],
            system_prompt=self.system_prompt,
            settings=self.settings,
            eviction=self.eviction,
            tensors=tensors_of(self.cache, self.sampler) if whole else None,
            recalled={index: note for index, note in self.recalled.items() if index < len(self.transcript)},
            tools=self.tools,
        )

    def restore(self, state: ConversationState, not_exact: str | None = None) -> SessionTask:
        """Become the conversation `state`: exactly when it carries tensors that fit, else replayed
        (`not_exact` says why there are none, for the NotResumed event). ConfigError, and nothing
        changes, when its eviction or system prompt cannot be used."""
        eviction = eviction_policy(state.eviction)
        chat_format = chat_format_for(self.tokenizer, state.system_prompt, state.tools)
        feeds = fed_ids(chat_format, state.messages, state.recalled)
        self._use_format(chat_format)
        self.settings, self.eviction = state.settings, eviction
        self.sampler = Sampler(state.settings.seed)
        return self._restored(state, feeds, not_exact)

    def _restored(self, state: ConversationState, feeds: list[list[int]], not_exact: str | None) -> SessionTask:
        if state.tensors is not None:
            index = self._recall_index.kept_for(self.transcript, state.messages)
            self.reset()
            self._settled = False
            try:
                self.sampler = restore_tensors(self.cache, state.tensors, self.device)
            except CacheStateError as error:
                not_exact = str(error)
            else:
                self.transcript = [message.copy() for message in state.messages]
                self.recalled = dict(state.recalled)
                self._recall_index = index
                self._settled = True
                yield CacheOccupancy(self.cache_stats(), 0.0)
                yield Resumed(messages=len(state.messages), tokens=self.cache_stats().used)
                return
        if not_exact is not None:
            yield NotResumed(not_exact)
        yield from self._replay(state.messages, feeds, state.recalled)

    def _replay(
        self, messages: list[Message], feeds: list[list[int]], recalled: dict[int, RecalledNote] | None = None
    ) -> SessionTask:
        """Feed the sinks and the end of the conversation; the middle would only be evicted again."""
        self.reset()
        self.recalled = dict(recalled or {})
        self._settled = False
        total = sum(len(ids) for ids in feeds)
        progress = self.token_loop.replay_progress(total)
        yield CacheOccupancy(self.cache_stats(), 0.0)  # the emptied cache, not the one the replay replaces
        if (started := progress.advance(0)) is not None:
            yield started  # shown before the first forward pass, which takes a while
        start = copied = 0
        for index, (message, ids) in enumerate(zip(messages, feeds, strict=True)):
            self.transcript.append(message.copy())
            copied += yield from self.token_loop.replay_message(ids, start, total, index, progress)
            start += len(ids)
        self._settled = True
        yield CacheOccupancy(self.cache_stats(), 0.0)
        yield Replayed(messages=len(messages), tokens=self.cache_stats().seen, copied=copied)

    # ---- a turn in the transcript -------------------------------------------------------------

    def _reply(
        self,
        logits: torch.Tensor,
        prompt_tokens: int,
        started: float,
        prefilled: float,
        copied: int = 0,
        logprobs: int | None = None,
    ) -> SessionTask:
        """Generate the answer to the last message, then close the turn in the cache and the transcript."""
        message = len(self.transcript)
        self.transcript.append({"role": "assistant", "content": ""})
        reply = Reply(self.tokenizer, self.settings, started, prefilled)
        conversation = self._conversation
        try:
            yield from self.token_loop.decode(
                logits, reply, message, self.sampler, self.stop_ids, logprobs, self.reply_format
            )
        except Abandoned:
            # Its consumer went away: the reply is closed all the same, unheard (the driver runs the steps), so
            # the next turn works; unless the conversation was replaced meanwhile (reset, replay, recover).
            if conversation == self._conversation:
                reply.reason = "interrupted"
                yield from self._close(reply, message)
            raise
        yield from self._close(reply, message)
        stats = reply.stats(prompt_tokens, copied)
        yield CacheOccupancy(self.cache_stats(), stats.decode_tokens_per_second)
        yield TurnFinished(reply=reply.text, stats=stats)

    def _close(self, reply: Reply, message: int) -> SessionTask:
        """Record the reply's text, then feed what closes it (the end of turn)."""
        tail = reply.flush()
        if tail:
            yield TextDelta(tail)
        self.transcript[message]["content"] = reply.text
        closing = list(self.chat_format.end_of_turn_ids)
        if closing:
            yield from self.token_loop.feed(closing, message)
        self._settled = True

    def _reply_reach(self) -> int:
        """How many tokens a reply can feed: the longest one and the end of its turn."""
        return self.settings.max_new_tokens + len(self.chat_format.end_of_turn_ids)

    # ---- recall ----------------------------------------------------------------------------

    def next_prompt(self, text: str) -> tuple[list[int], RecalledNote | None]:
        """The tokens chat(text) would feed now, and the recall note among them; the conversation does not move
        (a benchmark teacher-forces an answer after them)."""
        note = self._recall(text)
        return self.chat_format.prompt_ids(fed_text(text, note), first_turn=self.cache_stats().seen == 0), note

    def recall_search(self, text: str, bar: float = defaults.RECALL_MIN_RELEVANCE) -> list[Passage]:
        """The evicted passages relevant to `text` now, best first, each with its relevance: what the note is
        chosen from (a benchmark shows it; `bar` 0 shows every passage that shares a word with `text`)."""
        return self._recall_index.search_forgotten(self.transcript, self.cache_view(), self.recalled, text, bar)

    def _recall(self, text: str) -> RecalledNote | None:
        """The note that brings back what the cache forgot and `text` needs; None when nothing clears the bar (or
        recall is off)."""
        found = self.recall_search(text) if self.recall != "off" else []
        return recall_note(found, self._count_tokens, note_budget(self.window)) if found else None

    def _count_tokens(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    # ---- helpers ---------------------------------------------------------------------------

    def _use_format(self, chat_format: ChatFormat) -> None:
        """Talk in `chat_format` from now on, through a cache that keeps its prefix (a new one if it must)."""
        kept = kept_tokens(chat_format, self.keep, self.window)
        generation_config = getattr(self.model, "generation_config", None)
        self.stop_ids = stop_token_ids(self.tokenizer, generation_config, chat_format)
        self.chat_format = chat_format
        self._settled = not self.transcript  # a conversation in the cache was read in another format
        if self.token_loop.sinks != kept:  # None: no cache yet
            self._snapshot = None  # its copies of the old cache go before the new one is allocated
            self.token_loop.use_sinks(kept)

    def _forget_snapshot(self) -> None:
        """The last reply can no longer be regenerated: the cache may rebase again."""
        self._snapshot = None
        release_snapshots(self.cache)
