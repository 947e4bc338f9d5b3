"""Token bookkeeping for the sink cache: which slot holds which token, what to evict, where tokens sit.

Pure integer arithmetic: no tensors, so every rule here is testable on its own.

Geometry (StreamingLLM with positions assigned within the cache):
- The first `sinks` tokens of the stream stay forever in sink slots.
- The `window` most recent tokens live in a ring of slots; the oldest are evicted.
- Window keys are stored rotated at their own position and never re-rotated: the
  window is a contiguous run of the most recent tokens, so its distances to a new
  query are already the in-cache ones. Only the sinks must appear right before the
  window; they are rotated by `sink_shift` from a pristine copy at each eviction.
- Positions grow with the stream. Once they pass `rebase_at`, everything is moved
  back by `sink_shift` in one rotation, rarely enough (at least `window` tokens apart)
  that no token is rotated twice in its lifetime.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamchat.errors import CacheConfigError

Run = tuple[int, int]  # a [start, stop) range of slots


@dataclass
class Ring:
    """`capacity` slots holding a contiguous run of the most recent tokens, oldest at `head`."""

    capacity: int
    head: int = 0
    length: int = 0

    @property
    def is_full(self) -> bool:
        return self.length == self.capacity

    def pop(self, count: int) -> None:
        """Forget the `count` oldest tokens."""
        self.head = (self.head + count) % self.capacity
        self.length -= count

    def push(self, count: int) -> tuple[Run, ...]:
        """Claim `count` free slots after the newest token, as one or two contiguous runs."""
        start = (self.head + self.length) % self.capacity
        first = min(count, self.capacity - start)
        self.length += count
        if first == count:
            return ((start, start + count),)
        return ((start, self.capacity), (0, count - first))

    def reorder(self) -> int:
        """Declare the slots reordered oldest-first from slot 0; return how far they were rolled."""
        rolled, self.head = self.head, 0
        return rolled


@dataclass(frozen=True)
class CacheStats:
    """What the cache holds right now, and what has streamed through it."""

    sinks_held: int
    sink_capacity: int
    window_used: int
    window_capacity: int
    seen: int
    evicted: int

    @property
    def capacity(self) -> int:
        return self.sink_capacity + self.window_capacity

    @property
    def used(self) -> int:
        return self.sinks_held + self.window_used


@dataclass(frozen=True)
class Eviction:
    """`count` tokens left the window: stream indices `first_index`..`last_index`, inclusive."""

    count: int
    first_index: int
    last_index: int
    stats: CacheStats


@dataclass(frozen=True)
class SinkStep:
    """What every sink layer does with one forward pass of `incoming` tokens."""

    incoming: int
    sink_slots: Run  # where the first tokens of the step go while sinks are still filling
    window_runs: tuple[Run, ...]  # ring slots of the remaining tokens, in order
    roll: int  # after writing, roll the window by -roll so slot order is age order (0: leave it)
    sink_shift: int
    used: int  # slots [0, used) hold the cache after the step
    eviction: Eviction | None


@dataclass(frozen=True)
class SlidingStep:
    """What every layer with the model's own sliding window does with one forward pass."""

    incoming: int
    roll: int  # before reading, roll the ring by -roll so slot order is age order
    kept_slots: Run  # old tokens returned ahead of the new ones (the last sliding_window - 1)
    stored: int  # how many of the newest incoming tokens the ring keeps
    runs: tuple[Run, ...]  # ring slots for those tokens
    used: int  # decode steps return slots [0, used); longer steps return old + new


class StreamLedger:
    """The sinks, the rolling window and the position clock shared by all sink layers."""

    def __init__(self, sinks: int, window: int) -> None:
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise CacheConfigError(f"sinks={sinks!r}: must be a whole number >= 0")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise CacheConfigError(f"window={window!r}: must be a whole number >= 1 (a decode step needs one slot)")
        self.sinks = sinks
        self.window = window
        self.sinks_held = 0
        self.ring = Ring(window)
        self.seen = 0
        self.evicted = 0
        # Window token t sits at position t - position_offset; each rebase raises the offset.
        self.position_offset = 0

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    @property
    def used(self) -> int:
        return self.sinks_held + self.ring.length

    @property
    def next_position(self) -> int:
        """The rotary position the next token takes."""
        return self.seen - self.position_offset

    @property
    def sink_shift(self) -> int:
        """How far the sinks' positions move from 0..sinks-1 so they sit right before the window."""
        if self.sinks_held < self.sinks:
            return 0
        return self.next_position - self.ring.length - self.sinks

    @property
    def rebase_at(self) -> int:
        # At least `window` tokens pass between rebases (after one, next_position <= capacity),
        # so no token sees two of them, and no key is rounded more than twice.
        return self.capacity + self.window

    @property
    def max_shift(self) -> int:
        """The largest sink shift a caller that lets the cache rebase can meet."""
        return self.rebase_at + self.capacity

    def stats(self) -> CacheStats:
        return CacheStats(
            sinks_held=self.sinks_held,
            sink_capacity=self.sinks,
            window_used=self.ring.length,
            window_capacity=self.window,
            seen=self.seen,
            evicted=self.evicted,
        )

    def split(self, incoming: int) -> tuple[int, int]:
        """How many of `incoming` tokens become sinks, and how many enter the window."""
        if isinstance(incoming, bool) or not isinstance(incoming, int) or incoming < 1:
            raise CacheConfigError(f"incoming={incoming!r}: a step feeds at least one token")
        to_sinks = min(incoming, self.sinks - self.sinks_held)
        to_window = incoming - to_sinks
        if to_window > self.window:
            raise CacheConfigError(
                f"{incoming} tokens in one step do not fit a window of {self.window}: "
                f"feed at most {self.window} at a time (streamchat.cache.feeding chunks for you)"
            )
        return to_sinks, to_window

    def overflow(self, incoming: int) -> int:
        """How many window tokens must leave so that `incoming` tokens fit."""
        _, to_window = self.split(incoming)
        return max(0, self.ring.length + to_window - self.window)

    def evict(self, count: int) -> Eviction | None:
        """Drop the `count` oldest window tokens (never sinks)."""
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= self.ring.length:
            raise CacheConfigError(f"cannot evict {count!r} tokens from a window holding {self.ring.length}")
        if count == 0:
            return None
        first = self.seen - self.ring.length
        self.ring.pop(count)
        self.evicted += count
        return Eviction(count=count, first_index=first, last_index=first + count - 1, stats=self.stats())

    def step(self, incoming: int) -> SinkStep:
        """Make room for `incoming` tokens, assign their slots and advance the clock."""
        to_sinks, to_window = self.split(incoming)
        eviction = self.evict(self.overflow(incoming))
        sink_slots = (self.sinks_held, self.sinks_held + to_sinks)
        self.sinks_held += to_sinks
        window_runs = self.ring.push(to_window) if to_window else ()
        self.seen += incoming
        # A decode step into a full ring may leave the slots out of age order: attention
        # is order-free for a single query. Otherwise the causal mask needs age order.
        needs_order = incoming > 1 or not self.ring.is_full
        roll = self.ring.reorder() if needs_order and self.ring.head else 0
        return SinkStep(
            incoming=incoming,
            sink_slots=sink_slots,
            window_runs=window_runs,
            roll=roll,
            sink_shift=self.sink_shift,
            used=self.used,
            eviction=eviction,
        )

    def mask_sizes(self, incoming: int) -> tuple[int, int]:
        """(kv_length, kv_offset) of the keys the next step returns, as transformers' masks expect."""
        evicting = self.overflow(incoming)
        return self.used - evicting + incoming, evicting

    def rebase(self) -> int:
        """Move positions back so the sinks need no shift; return the distance moved."""
        delta = self.sink_shift
        self.position_offset += delta
        return delta


class SlidingLedger:
    """The ring of a model's own sliding-window layers: each query sees the last `sliding_window` tokens."""

    def __init__(self, sliding_window: int) -> None:
        if sliding_window < 1:
            raise CacheConfigError(f"sliding_window={sliding_window}: must be >= 1")
        self.sliding_window = sliding_window
        self.ring = Ring(sliding_window)

    @property
    def kept(self) -> int:
        """Old tokens the next query can still see."""
        return min(self.ring.length, self.sliding_window - 1)

    def step(self, incoming: int) -> SlidingStep:
        old_length = self.ring.length
        kept_slots = (old_length - self.kept, old_length)
        roll = self.ring.reorder() if incoming > 1 and self.ring.head else 0
        stored = min(incoming, self.ring.capacity)
        self.ring.pop(max(0, self.ring.length + stored - self.ring.capacity))
        runs = self.ring.push(stored)
        return SlidingStep(
            incoming=incoming,
            roll=roll,
            kept_slots=kept_slots,
            stored=stored,
            runs=runs,
            used=self.ring.length,
        )

    def mask_sizes(self, incoming: int) -> tuple[int, int]:
        return self.kept + incoming, 0
