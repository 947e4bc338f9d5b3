"""What the model still sees, and which transcript messages it has forgotten, read from the cache's record.

The cache records each token it holds with the label it was fed with (streamchat.cache.record);
the token loop feeds every token labelled with its transcript message index, so messages
count up along the stream. A view of that record says what an eviction forgot, which tokens
the model sees, and what recall may bring back.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamchat.cache.record import HeldTokens


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

    @classmethod
    def of(cls, held: HeldTokens) -> CacheView:
        """The view of what a cache holds (SinkCache.held_tokens), its labels read as message indices."""
        last_forgotten = held.last_forgotten_label
        first_message = held.window_labels[0] if held.window_labels else last_forgotten + 1
        partly = first_message if last_forgotten == first_message else None
        forgotten_messages = first_message if held.forgotten else 0
        return cls(
            sink_ids=held.sink_ids,
            window_ids=held.window_ids,
            forgotten_tokens=held.forgotten,
            forgotten_messages=max(forgotten_messages, 0),
            partly_forgotten_message=partly,
        )

    @property
    def token_ids(self) -> list[int]:
        """Every token the model sees, in the order it sees them."""
        return [*self.sink_ids, *self.window_ids]
