"""What the engine tells the UI: typed events, yielded in order. The UI renders them and nothing else."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from streamchat.cache.ledger import CacheStats

StopReason = Literal["eos", "stop_string", "max_new_tokens", "interrupted"]


@dataclass(frozen=True)
class TextDelta:
    """The next piece of the reply's text (never a split character)."""

    text: str


@dataclass(frozen=True)
class TokenLogprob:
    """A reply token's log-probability under the model (its own logits, before any penalty or temperature), and
    the likeliest tokens' at the same step, best first (as many as asked for): each as its text and value."""

    text: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


@dataclass(frozen=True)
class Evicted:
    """Tokens left the window: `count` of them, stream indices first..last, and their text."""

    count: int
    first_index: int
    last_index: int
    text: str
    stats: CacheStats


@dataclass(frozen=True)
class PromptTruncated:
    """A prompt overflowed the cache as it streamed in: its own first tokens were evicted."""

    prompt_tokens: int
    visible_tokens: int

    @property
    def dropped_tokens(self) -> int:
        return self.prompt_tokens - self.visible_tokens


@dataclass(frozen=True)
class PromptSkipped:
    """Only part of a prompt was read: `too_long` for the cache (its start and its end were read,
    as a replay reads a conversation), or `stopped` by stop() while it was read."""

    prompt_tokens: int
    read_tokens: int
    reason: Literal["too_long", "stopped"]


@dataclass(frozen=True)
class PromptProgress:
    """A prompt, or a conversation replayed, that takes more than one forward pass is being read: so far,
    of all that will be read."""

    read_tokens: int
    total_tokens: int
    tokens_per_second: float
    reading: Literal["message", "conversation"] = "message"  # a user's message, or a conversation replayed

    @property
    def seconds_left(self) -> float | None:
        if self.tokens_per_second <= 0:
            return None
        return (self.total_tokens - self.read_tokens) / self.tokens_per_second


@dataclass(frozen=True)
class Recalled:
    """Passages of messages that had left the cache come back with the new message, in a note before it."""

    passages: int
    turns: tuple[int, ...]  # the turns they came from (1 = the first exchange)
    tokens: int  # the note's, read with the message


@dataclass(frozen=True)
class CacheOccupancy:
    """How full the cache is now, and the decode speed so far this turn (0 before the first token)."""

    stats: CacheStats
    decode_tokens_per_second: float


@dataclass(frozen=True)
class TurnStats:
    prompt_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    time_to_first_token: float
    stop_reason: StopReason
    copied_prompt_tokens: int = 0  # of prompt_tokens, the sinks copied in as another conversation read them
    stop_string: str | None = None  # the stop string that ended the reply, where one did

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        # The first token comes from the prefill's logits; the rest each cost one decode step.
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0


@dataclass(frozen=True)
class TurnFinished:
    """The reply is complete (or was stopped) and closed in the cache and the transcript."""

    reply: str
    stats: TurnStats


@dataclass(frozen=True)
class Compiling:
    """The first decode step is being compiled (once per start; it takes a while)."""


@dataclass(frozen=True)
class Compiled:
    """The decode step is compiled; `seconds` it took."""

    seconds: float


@dataclass(frozen=True)
class Replayed:
    """A transcript was fed through the cache (after /load or a new system prompt)."""

    messages: int
    tokens: int  # fed: the sinks and the end of the conversation, not the middle it would evict
    copied: int = 0  # of `tokens`, the sinks copied in as another conversation read them (not read)


@dataclass(frozen=True)
class Resumed:
    """A saved conversation goes on exactly where it stopped: its saved cache state was restored, not replayed."""

    messages: int
    tokens: int  # in the cache


@dataclass(frozen=True)
class NotResumed:
    """A saved conversation's cache state could not be used (`reason`, one line): it is replayed instead."""

    reason: str


Event = (
    TextDelta
    | TokenLogprob
    | Evicted
    | PromptTruncated
    | PromptSkipped
    | PromptProgress
    | Recalled
    | CacheOccupancy
    | TurnFinished
    | Replayed
    | Resumed
    | NotResumed
    | Compiling
    | Compiled
)
