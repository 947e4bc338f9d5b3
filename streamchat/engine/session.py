"""ChatSession: one model, one tokenizer, one sink cache and one transcript, for as long as the chat lasts.

Each call that moves the conversation (chat, regenerate, replay) returns an iterator of
events; the conversation advances as the caller consumes it. Every token is fed exactly
once, in conversation order: the cache is never recomputed, only reset when asked.

    session = ChatSession(model, tokenizer, SessionOptions())
    for event in session.chat("Hello!"):
        ...  # TextDelta, Evicted, CacheOccupancy, ..., TurnFinished
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from streamchat.cache import CacheStats, SinkCache
from streamchat.cache.feeding import chunk_sizes, forward
from streamchat.cache.ledger import Eviction
from streamchat.cache.snapshots import release_snapshots
from streamchat.engine.cache_file import SavedState, StateKey, read_state, state_path
from streamchat.engine.decoder import Decoder
from streamchat.engine.events import (
    CacheOccupancy,
    Compiled,
    Compiling,
    Event,
    Evicted,
    NotResumed,
    PromptSkipped,
    PromptTruncated,
    Replayed,
    Resumed,
    TextDelta,
    TurnFinished,
)
from streamchat.engine.kept_prefix import kept_tokens
from streamchat.engine.mirror import CacheMirror, CacheView
from streamchat.engine.out_of_memory import out_of_memory_reported
from streamchat.engine.prompt_reading import REPLAYED_WINDOWS, ReadingProgress, prompt_parts, replayed_parts
from streamchat.engine.regen import RegenPoint
from streamchat.engine.reply import Reply
from streamchat.engine.sampling import Sampler
from streamchat.engine.session_file import SavedSession, read_session, save_session
from streamchat.engine.session_options import SessionOptions, eviction_policy
from streamchat.engine.session_state import restore_session_tensors, write_session_state
from streamchat.engine.settings import GenerationSettings
from streamchat.engine.template import ChatFormat, Message, stop_token_ids
from streamchat.errors import CacheStateError, ConfigError


class ChatSession:
    def __init__(self, model: Any, tokenizer: Any, options: SessionOptions | None = None) -> None:
        options = options or SessionOptions()
        self.model = model
        self.tokenizer = tokenizer
        self.eviction = options.eviction
        self.prefill_chunk = options.prefill_chunk
        self.read_all = options.read_all
        self.settings = options.settings or GenerationSettings.from_generation_config(
            getattr(model, "generation_config", None)
        )
        self.sampler = Sampler(self.settings.seed)
        self.keep, self.window, self.compile_backend = options.keep, options.window, options.compile_backend
        # Under tensor parallelism: how the ranks agree on tokens and stops (streamchat.distributed).
        self.channel = options.channel
        self.device = model.get_input_embeddings().weight.device
        self.cache: SinkCache | None = None
        self.transcript: list[Message] = []
        self._stop_requested = False
        # The cache holds exactly the transcript: no turn, replay or resume is half done.
        self._settled = True
        self._snapshot: RegenPoint | None = None
        self._conversation = 0  # counts resets: a reply abandoned before one must not close after it
        self._use_format(ChatFormat(tokenizer, system_prompt=options.system_prompt))

    # ---- reading the session --------------------------------------------------------------

    @property
    def system_prompt(self) -> str | None:
        return self.chat_format.system_prompt

    def cache_stats(self) -> CacheStats:
        return self.cache.stats()

    def cache_view(self) -> CacheView:
        return self.mirror.view()

    def decode(self, token_ids: list[int] | tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=False)

    # ---- moving the conversation ----------------------------------------------------------

    def chat(self, text: str) -> Iterator[Event]:
        """Feed a user message and stream the reply.

        A prompt longer than the cache can hold is read as a replay reads a conversation (see
        streamchat.engine.prompt_reading) unless read_all; a stop() while it is read ends the
        reading between two forward passes, and the reply before it starts.
        """
        self._stop_requested = self._settled = False
        self._forget_snapshot()
        self.transcript.append({"role": "user", "content": text})
        started = time.perf_counter()
        seen = self.cache_stats().seen
        prompt = self.chat_format.prompt_ids(text, first_turn=seen == 0)
        head, tail = prompt_parts(prompt, seen, self.cache.sinks, self.cache.window, self.read_all)
        wanted = len(head) + len(tail)
        if wanted < len(prompt):
            yield PromptSkipped(len(prompt), wanted, "too_long")
        yield from self._make_room(wanted)
        before = self.cache_stats()
        logits, read = yield from self._read_prompt(head, tail, len(prompt) - wanted, len(self.transcript) - 1)
        prefilled = time.perf_counter()
        # Evictions take the oldest window tokens first: past those, they took the prompt's own.
        dropped = self.cache_stats().evicted - before.evicted - before.window_used
        if read < wanted:
            yield PromptSkipped(len(prompt), read, "stopped")
        elif dropped > 0:
            yield PromptTruncated(prompt_tokens=len(prompt), visible_tokens=read - dropped)
        # /regen answers the same prompt again: not one that was read only in part.
        self._snapshot = RegenPoint.take(self, logits) if read == wanted else None
        yield from self._reply(logits, read, started, prefilled)

    def regenerate(self) -> Iterator[Event]:
        """Take back the last reply and generate another one for the same message."""
        if self._snapshot is None or not self.transcript or self.transcript[-1]["role"] != "assistant":
            raise ConfigError("there is no reply to regenerate yet")
        self.transcript.pop()
        self._stop_requested = self._settled = False
        started = time.perf_counter()
        logits = self._snapshot.restore(self)
        self._snapshot = RegenPoint.take(self, logits)  # the settings, and so the reply's reach, may have changed
        yield CacheOccupancy(self.cache_stats(), 0.0)
        yield from self._reply(logits, 0, started, started)

    def recover(self) -> Iterator[Event]:
        """After a turn was torn off mid-step (a second Ctrl-C), make the session whole again.

        A cache that missed part of a forward pass is rebuilt from the transcript. A turn
        without a reply is dropped: a reply must follow a prompt in the cache.
        """
        messages = list(self.transcript)
        if messages and messages[-1]["role"] == "assistant" and not messages[-1]["content"]:
            messages.pop()
        if messages and messages[-1]["role"] == "user":
            messages.pop()
        if messages == self.transcript and self._cache_whole():
            return iter(())
        return self.replay(messages)

    def stop(self) -> None:
        """Ask the reply being generated to end after the current token (safe from a signal handler)."""
        self._stop_requested = True

    def reset(self) -> None:
        """Forget the conversation: an empty cache and an empty transcript."""
        self._conversation += 1
        self._forget_snapshot()
        self.cache.reset()
        self.mirror = CacheMirror(self.cache.sinks)
        self.transcript = []
        self._snapshot = None
        self._settled = True

    def set_system_prompt(self, text: str | None) -> Iterator[Event]:
        """Use a new system prompt: the conversation so far is replayed behind it (in a new cache when the
        kept prefix changes length); ConfigError, and nothing changes, when it is too long to keep."""
        chat_format = ChatFormat(self.tokenizer, system_prompt=text or None)
        feeds = chat_format.conversation_ids(self.transcript)
        self._use_format(chat_format)
        return self._replay(list(self.transcript), feeds)

    def set_option(self, key: str, value: str) -> None:
        """Change a generation setting (or `eviction`) from text, as typed after /set."""
        if key == "eviction":
            self.eviction = eviction_policy(value)
            return
        self.settings = self.settings.with_value(key, value)
        if key == "seed":
            self.sampler = Sampler(self.settings.seed)

    def options(self) -> list[tuple[str, str]]:
        """Every setting /set can change, with its value as text."""
        return [*self.settings.as_pairs(), ("eviction", self.eviction)]

    def replay(self, messages: list[Message]) -> Iterator[Event]:
        """Start over and feed a conversation through the cache, as if it had been typed and answered."""
        return self._replay(messages, self.chat_format.conversation_ids(messages))

    def save(self, path: Path, model_name: str | None = None) -> None:
        """Write the conversation, less a last message still waiting for its reply."""
        settings = dict(self.settings.as_pairs())
        answered = self.transcript[: len(self.transcript) // 2 * 2]
        saved = SavedSession(answered, self.system_prompt, settings, self.eviction, model_name)
        save_session(path, saved)

    def load(self, path: Path, key: StateKey | None = None) -> Iterator[Event]:
        """Replace this conversation with a saved one; nothing changes if the file is bad.

        With `key`, the cache state saved beside the file (cache_file.py) is restored when it
        fits `key` and the conversation, and the session goes on exactly as it would have;
        otherwise, or without `key`, the conversation is replayed.
        """
        saved = read_session(path)
        state = read_state(state_path(path), key, saved) if key is not None else None
        return self.load_saved(saved, state)

    def load_saved(self, saved: SavedSession, state: SavedState | str | None = None) -> Iterator[Event]:
        """Replace this conversation with one read already (`state`: as for _resume); nothing changes if it is bad."""
        settings = self.settings
        for name, value in saved.settings.items():
            settings = settings.with_value(name, value)
        eviction = eviction_policy(saved.eviction)
        chat_format = ChatFormat(self.tokenizer, system_prompt=saved.system_prompt)
        feeds = chat_format.conversation_ids(saved.messages)
        self._use_format(chat_format)
        self.settings, self.eviction, self.sampler = settings, eviction, Sampler(settings.seed)
        return self._resume(saved.messages, feeds, state)

    def save_state(self, path: Path, key: StateKey) -> int | None:
        """Write the whole state to `path` (beside a session file: cache_file.state_path); its size in bytes.

        None, and nothing written, when no whole conversation is in the cache (a turn torn off half way).
        """
        if len(self.transcript) % 2 or not self._settled or not self._cache_whole():
            return None
        return write_session_state(self, path, key)

    def _resume(
        self, messages: list[Message], feeds: list[list[int]], state: SavedState | str | None
    ) -> Iterator[Event]:
        """Restore a saved state; or say why not (`state` is the reason), and replay the conversation."""
        if isinstance(state, SavedState):
            self.reset()
            self._settled = False
            try:
                restore_session_tensors(self, state.tensors, state.seed)
            except CacheStateError as error:
                state = str(error)
            else:
                self.transcript = [{"role": m["role"], "content": m["content"]} for m in messages]
                self._settled = True
                yield CacheOccupancy(self.cache_stats(), 0.0)
                yield Resumed(messages=len(messages), tokens=self.cache_stats().used)
                return
        if state is not None:
            yield NotResumed(state)
        yield from self._replay(messages, feeds)

    def _replay(self, messages: list[Message], feeds: list[list[int]]) -> Iterator[Event]:
        """Feed the sinks and the end of the conversation; the middle would only be evicted again."""
        self.reset()
        self._settled = False
        total = sum(len(ids) for ids in feeds)
        skip_from, skip_to = self.cache.sinks, total - REPLAYED_WINDOWS * self.cache.window
        start = 0
        for index, (message, ids) in enumerate(zip(messages, feeds, strict=True)):
            self.transcript.append({"role": message["role"], "content": message["content"]})
            head, tail = replayed_parts(ids, start, skip_from, skip_to)
            if head:
                yield from self._feed(head, message=index)
            self.mirror.skip(len(ids) - len(head) - len(tail), message=index)
            if tail:
                yield from self._feed(tail, message=index)
            start += len(ids)
        self._settled = True
        yield CacheOccupancy(self.cache_stats(), 0.0)
        yield Replayed(messages=len(messages), tokens=self.cache_stats().seen)

    # ---- the phases of a turn ---------------------------------------------------------------

    def _make_room(self, prompt_tokens: int) -> Iterator[Event]:
        """The paper's per-turn policy: reserve space for the prompt and the whole reply at once."""
        if self.eviction == "turn":
            reply_tokens = self.settings.max_new_tokens + len(self.chat_format.end_of_turn_ids)
            yield from self._evict_for(min(prompt_tokens + reply_tokens, self.cache.window))

    def _read_prompt(self, head: list[int], tail: list[int], skipped: int, message: int) -> Iterator[Event]:
        """Feed a prompt's head, count the `skipped` middle as forgotten, feed its tail; return
        (the last logits, tokens read). Progress is reported, and stop() heeded, between passes."""
        progress = ReadingProgress(len(head) + len(tail), min(self.prefill_chunk, self.cache.window))
        logits = None
        for part, skipped_after in ((head, skipped), (tail, 0)):
            for piece in progress.pieces(part):
                if logits is not None and self._stop_agreed():
                    return logits, progress.read
                logits = yield from self._feed(piece, message)
                if (event := progress.advance(len(piece))) is not None:
                    yield event
            self.mirror.skip(skipped_after, message)
        return logits, progress.read

    def _reply(self, logits: torch.Tensor, prompt_tokens: int, started: float, prefilled: float) -> Iterator[Event]:
        """Decode until a stop, then close the turn in the cache and the transcript."""
        message = len(self.transcript)
        self.transcript.append({"role": "assistant", "content": ""})
        reply = Reply(self.tokenizer, self.settings, started, prefilled)
        conversation = self._conversation
        try:
            yield from self._decode(logits, reply, message)
        except GeneratorExit:
            # The caller abandoned the reply: close it all the same, silently, so the next turn
            # works; unless the conversation was replaced meanwhile (reset, replay, recover).
            if conversation == self._conversation:
                reply.reason = "interrupted"
                _drain(self._close(reply, message))
                self._settled = True
            raise
        yield from self._close(reply, message)
        self._settled = True
        stats = reply.stats(prompt_tokens)
        yield CacheOccupancy(self.cache_stats(), stats.decode_tokens_per_second)
        yield TurnFinished(reply=reply.text, stats=stats)

    def _decode(self, logits: torch.Tensor, reply: Reply, message: int) -> Iterator[Event]:
        """Draw, show and feed tokens one by one, until a stop token or string, the limit, or stop()."""
        settings = reply.settings
        self.decoder.start(logits, settings, self.sampler)
        while True:
            compiling = self.decoder.will_compile and not self._stop_requested
            if compiling:
                yield Compiling()
            with out_of_memory_reported(self.device, "generating"):
                # Already fed: a token that ends the reply is taken back. None: stop() was heeded.
                decoded = self.decoder.next(self._stop_requested)
            if decoded is None:
                break
            if compiling and self.decoder.compile_seconds is not None:
                yield Compiled(self.decoder.compile_seconds)
            if decoded.token in self.stop_ids:
                self.decoder.take_back()
                reply.reason = "eos"
                return
            delta = reply.add(decoded.token)
            self.mirror.append([decoded.token], message)
            evicted = self._evicted(decoded.eviction) if decoded.eviction is not None else None
            if delta:
                yield TextDelta(delta)
            if evicted is not None:
                yield evicted
            if reply.reason == "stop_string" or len(reply.ids) >= settings.max_new_tokens:
                return
            yield CacheOccupancy(self.cache_stats(), reply.decode_speed())
        reply.reason = "interrupted"

    def _close(self, reply: Reply, message: int) -> Iterator[Event]:
        """Feed what closes the reply (the end of turn) and record its text."""
        tail = reply.flush()
        if tail:
            yield TextDelta(tail)
        self.transcript[message]["content"] = reply.text
        closing = list(self.chat_format.end_of_turn_ids)
        if closing:
            yield from self._feed(closing, message)

    def _feed(self, token_ids: list[int], message: int) -> Iterator[Event]:
        """Feed tokens in chunks, evicting what does not fit; return the last position's logits."""
        logits = None
        start = 0
        with torch.inference_mode():
            for size in chunk_sizes(len(token_ids), self.cache, self.prefill_chunk):
                chunk = token_ids[start : start + size]
                yield from self._evict_for(size)
                with out_of_memory_reported(self.device, f"reading {size} tokens"):
                    logits = forward(self.model, self.cache, torch.tensor([chunk], device=self.device))
                self.mirror.append(chunk, message)
                start += size
        return logits

    def _evict_for(self, incoming: int) -> Iterator[Event]:
        """Make room for `incoming` tokens; report what that evicted."""
        eviction = self.cache.evict_for_space(incoming)
        if eviction is not None:
            yield self._evicted(eviction)

    def _evicted(self, eviction: Eviction) -> Evicted:
        """The event for an eviction the cache made; the mirror forgets the same tokens."""
        text = self.tokenizer.decode(self.mirror.evict(eviction.count), skip_special_tokens=False)
        return Evicted(eviction.count, eviction.first_index, eviction.last_index, text, eviction.stats)

    # ---- helpers ---------------------------------------------------------------------------

    def _use_format(self, chat_format: ChatFormat) -> None:
        """Talk in `chat_format` from now on, through a cache that keeps its prefix (a new one if it must)."""
        kept = kept_tokens(chat_format, self.keep, self.window)
        generation_config = getattr(self.model, "generation_config", None)
        self.stop_ids = stop_token_ids(self.tokenizer, generation_config, chat_format)
        self.chat_format = chat_format
        self._settled = not self.transcript  # a conversation in the cache was read in another format
        if self.cache is None or self.cache.sinks != kept:
            self._snapshot = self.cache = None  # the old storage goes before the new one is allocated
            self.cache = SinkCache.for_model(self.model, kept, self.window)
            self.decoder = Decoder(
                self.model, self.cache, self.compile_backend, vocab_size=len(self.tokenizer), channel=self.channel
            )
            self.mirror = CacheMirror(kept)

    def _stop_agreed(self) -> bool:
        """stop() as every rank sees it: the leader's, under tensor parallelism."""
        if self.channel is None:
            return self._stop_requested
        return self.channel.agree_stop(self._stop_requested)

    def _cache_whole(self) -> bool:
        """Whether the cache holds what the mirror says: no forward pass was torn off half way."""
        return self.cache.is_consistent() and len(self.mirror.token_ids()) == self.cache_stats().used

    def _forget_snapshot(self) -> None:
        """The last reply can no longer be regenerated: the cache may rebase again."""
        self._snapshot = None
        release_snapshots(self.cache)


def _drain(events: Iterator[Event]) -> None:
    for _ in events:
        pass
