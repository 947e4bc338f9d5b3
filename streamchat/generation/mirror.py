"""Which tokens the cache holds, and which transcript message each came from.

The cache keeps keys and values, not tokens. The engine mirrors its contents (the
sink tokens and the window, bounded by the cache's capacity) so it can say what an
eviction forgot, penalise repetition over what the model sees, and describe the cache.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# What the mirror is told when a token belongs to no message: it never happens for a
# conversation fed through the session, whose every token belongs to a message.
NO_MESSAGE = -1


@dataclass(frozen=True)
class CacheView:
    """What the model still sees, and what it has forgotten."""

    sink_ids: tuple[int, ...]
    window_ids: tuple[int, ...]
    forgotten_tokens: int
    # Transcript messages whose every token (sinks aside) has left the window.
    forgotten_messages: int
    # The message the window starts in, when its beginning has been evicted.
    partly_forgotten_message: int | None


class CacheMirror:
    def __init__(self, sinks: int) -> None:
        self.sink_capacity = sinks
        self.sinks: list[tuple[int, int]] = []  # (token id, message index)
        self.window: deque[tuple[int, int]] = deque()
        self.forgotten = 0
        self.last_forgotten_message = NO_MESSAGE  # the message the latest forgotten token came from

    def append(self, token_ids: list[int], message: int) -> None:
        for token_id in token_ids:
            if len(self.sinks) < self.sink_capacity:
                self.sinks.append((token_id, message))
            else:
                self.window.append((token_id, message))

    def evict(self, count: int) -> list[int]:
        """Forget the `count` oldest window tokens; return their ids."""
        evicted = [self.window.popleft() for _ in range(count)]
        self.forgotten += count
        if evicted:
            self.last_forgotten_message = evicted[-1][1]
        return [token_id for token_id, _ in evicted]

    def skip(self, count: int, message: int) -> None:
        """Count `count` tokens of `message` as forgotten without their ever entering the window."""
        if count:
            self.forgotten += count
            self.last_forgotten_message = message

    def copy(self) -> CacheMirror:
        clone = CacheMirror(self.sink_capacity)
        clone.sinks, clone.window = list(self.sinks), deque(self.window)
        clone.forgotten, clone.last_forgotten_message = self.forgotten, self.last_forgotten_message
        return clone

    def token_ids(self) -> list[int]:
        return [token_id for token_id, _ in self.sinks] + [token_id for token_id, _ in self.window]

    def view(self) -> CacheView:
        first_message = self.window[0][1] if self.window else self.last_forgotten_message + 1
        partly = first_message if self.last_forgotten_message == first_message else None
        forgotten_messages = first_message if self.forgotten else 0
        return CacheView(
            sink_ids=tuple(token_id for token_id, _ in self.sinks),
            window_ids=tuple(token_id for token_id, _ in self.window),
            forgotten_tokens=self.forgotten,
            forgotten_messages=max(forgotten_messages, 0),
            partly_forgotten_message=partly,
        )
