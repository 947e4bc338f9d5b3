"""Token bookkeeping for the sink cache: which slot holds which token, what to evict, where tokens sit.

Pure integer arithmetic: no tensors, so every rule here is testable on its own.

Geometry (StreamingLLM with positions assigned within the cache):
- The first `sinks` tokens of the stream stay forever in sink slots.
- The `window` most recent tokens live in a ring of slots; the oldest are evicted.
- Slots never move. Token t of the window always lives in ring slot (t - sinks) mod
  (window + 1): the ring has one slot more than it may hold, so a new token is always
  written into a free slot and an eviction only marks a slot unused. A pass can then
  be taken back (a speculative decode pass whose token ended the reply) without
  copying anything, and attention finds the cache's tokens through a mask.
- Window keys are stored rotated at their own position and never re-rotated: the
  window is a contiguous run of the most recent tokens, so its distances to a new
  query are already the in-cache ones. Only the sinks must appear right before the
  window; they are rotated by `sink_shift` from a pristine copy at each pass.
- Positions grow with the stream. Once they pass `rebase_at`, everything is moved
  back by `sink_shift` in one rotation, rarely enough (at least `window` tokens apart)
  that no token is rotated twice in its lifetime. A rebase may be held off while a
  reply runs (so that /regen can restore the few slots the reply overwrote), which
  is why `max_shift` leaves room for one more window.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from streamchat.errors import CacheConfigError, CacheStateError

# A decode pass needs one free slot in the window.
SMALLEST_WINDOW = 1
# The label of a token fed without one (record.py: the cache keeps each token's label, never reads it).
NO_LABEL = -1

Run = tuple[int, int]  # a [start, stop) range of slots


@dataclass
class Ring:
    """At most `capacity` of the most recent tokens, oldest at slot `head`, in `capacity + 1` slots."""

    capacity: int
    head: int = 0
    length: int = 0
    # Slots [0, extent) have been written at least once; eager passes attend over no more.
    extent: int = 0

    @property
    def slots(self) -> int:
        return self.capacity + 1

    @property
    def next_slot(self) -> int:
        """Where the next token goes: always a free slot."""
        return (self.head + self.length) % self.slots

    def runs(self, start: int, count: int) -> tuple[Run, ...]:
        """`count` consecutive slots from `start`, wrapping, as one or two runs."""
        first = min(count, self.slots - start)
        if first == count:
            return ((start, start + count),) if count else ()
        return ((start, self.slots), (0, count - first))

    def held(self) -> tuple[Run, ...]:
        """The slots holding tokens, oldest first."""
        return self.runs(self.head, self.length)

    def pop(self, count: int) -> tuple[Run, ...]:
        """Forget the `count` oldest tokens; return the slots they held."""
        freed = self.runs(self.head, count)
        self.head = (self.head + count) % self.slots
        self.length -= count
        return freed

    def push(self, count: int) -> tuple[Run, ...]:
        """Claim `count` free slots after the newest token (the caller made room)."""
        claimed = self.runs(self.next_slot, count)
        self.length += count
        for _, stop in claimed:
            self.extent = max(self.extent, stop)
        return claimed


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
    # Their ids, oldest first, from the cache's record (record.py) before any pass reuses their slots;
    # empty from a ledger alone, which counts tokens without knowing them.
    token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SinkPlacement:
    """Where one forward pass of `incoming` tokens goes in every sink layer."""

    incoming: int
    first_position: int  # the rotary position of the first incoming token
    sink_slots: Run  # where the first tokens of the pass go while sinks are still filling
    window_runs: tuple[Run, ...]  # ring slots of the remaining tokens, in order
    sink_shift: int
    extent: int  # slots [0, extent) (sinks, then ring) have been written, this pass's included


@dataclass(frozen=True)
class SlidingPlacement:
    """What every layer with the model's own sliding window does with one forward pass."""

    incoming: int
    kept: tuple[Run, ...]  # ring slots of the old tokens the new queries still see, oldest first
    freed: tuple[Run, ...]  # ring slots whose tokens left the ring
    stored_from: int  # the incoming tokens from this one on are stored (the ring keeps the newest)
    runs: tuple[Run, ...]  # ring slots for the stored tokens, in order
    extent: int


class StreamLedger:
    """The sinks, the rolling window and the position clock shared by all sink layers."""

    def __init__(self, sinks: int, window: int) -> None:
        if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
            raise CacheConfigError(f"sinks={sinks!r}: must be a whole number >= 0")
        if isinstance(window, bool) or not isinstance(window, int) or window < SMALLEST_WINDOW:
            raise CacheConfigError(
                f"window={window!r}: must be a whole number >= {SMALLEST_WINDOW} (a decode pass needs one slot)"
            )
        self.sinks = sinks
        self.window = window
        self.sinks_held = 0
        self.ring = Ring(window)
        self.seen = 0
        self.evicted = 0
        # Window token t sits at position t - position_offset; each rebase raises the offset.
        self.position_offset = 0
        # While set, a due rebase waits (a reply that /regen may take back is running).
        self.rebase_held = False
        # Tokens the feeder passed over without feeding them (a long prompt's unread middle): forgotten, never held.
        self.skipped = 0
        # The label of the latest token evicted or skipped: what a view calls partly forgotten (record.py).
        self.last_forgotten_label = NO_LABEL

    def copy(self) -> StreamLedger:
        clone = object.__new__(StreamLedger)
        clone.__dict__.update(self.__dict__)
        clone.ring = dataclasses.replace(self.ring)
        return clone

    @property
    def capacity(self) -> int:
        return self.stats().capacity

    @property
    def slots(self) -> int:
        """Physical slots: the sinks, then the ring (one more than the window)."""
        return self.sinks + self.ring.slots

    @property
    def used(self) -> int:
        return self.stats().used

    @property
    def forgotten(self) -> int:
        """Tokens of the stream no longer seen: evicted, or skipped without being fed."""
        return self.evicted + self.skipped

    @property
    def newest_slot(self) -> int:
        """The physical slot of the newest token held (the cache holds at least one)."""
        if self.ring.length:
            return self.sinks + (self.ring.head + self.ring.length - 1) % self.ring.slots
        return self.sinks_held - 1

    @property
    def sinks_full(self) -> bool:
        return self.sinks_held == self.sinks

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
    def rebase_due(self) -> bool:
        return self.next_position >= self.rebase_at and not self.rebase_held

    @property
    def max_shift(self) -> int:
        """The largest sink shift a pass can need: a held rebase defers by at most the ring's slots."""
        return self.rebase_at + self.ring.slots + self.window

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
            raise CacheConfigError(f"incoming={incoming!r}: a pass feeds at least one token")
        to_sinks = min(incoming, self.sinks - self.sinks_held)
        to_window = incoming - to_sinks
        if to_window > self.window:
            raise CacheConfigError(
                f"{incoming} tokens in one pass do not fit a window of {self.window}: "
                f"feed at most {self.window} at a time (a Reading, generation/requests.py, chunks for you)"
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

    def skip(self, count: int, label: int) -> None:
        """Count `count` tokens labelled `label` as forgotten without their ever being fed."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise CacheConfigError(f"cannot skip {count!r} tokens")
        if count:
            self.skipped += count
            self.last_forgotten_label = label

    def place(self, incoming: int) -> SinkPlacement:
        """Assign slots to `incoming` tokens and advance the clock; the window must have room."""
        to_sinks, to_window = self.split(incoming)
        if self.ring.length + to_window > self.window:
            raise CacheConfigError(f"no room for {incoming} tokens: evict_for_space({incoming}) first")
        first_position = self.next_position
        sink_slots = (self.sinks_held, self.sinks_held + to_sinks)
        self.sinks_held += to_sinks
        window_runs = self.ring.push(to_window)
        self.seen += incoming
        return SinkPlacement(
            incoming=incoming,
            first_position=first_position,
            sink_slots=sink_slots,
            window_runs=window_runs,
            sink_shift=self.sink_shift,
            extent=self.sinks + self.ring.extent,
        )

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

    def copy(self) -> SlidingLedger:
        clone = SlidingLedger(self.sliding_window)
        clone.ring = dataclasses.replace(self.ring)
        return clone

    @property
    def slots(self) -> int:
        return self.ring.slots

    @property
    def kept(self) -> int:
        """Old tokens the next query can still see."""
        return min(self.ring.length, self.sliding_window - 1)

    def place(self, incoming: int) -> SlidingPlacement:
        """The ring keeps the newest `sliding_window` tokens; the pass's queries see the last ones before."""
        kept = self.kept
        kept_runs = self.ring.runs((self.ring.head + self.ring.length - kept) % self.ring.slots, kept)
        stored = min(incoming, self.ring.capacity)
        freed = self.ring.pop(max(0, self.ring.length + stored - self.ring.capacity))
        runs = self.ring.push(stored)
        return SlidingPlacement(
            incoming=incoming,
            kept=kept_runs,
            freed=freed,
            stored_from=incoming - stored,
            runs=runs,
            extent=self.ring.extent,
        )


def known_sliding(sliding: SlidingLedger | None) -> SlidingLedger:
    """The sliding layers' ledger, for a caller whose cache has such layers (CacheStateError where it has none)."""
    if sliding is None:
        raise CacheStateError("the cache has no sliding-window layers")
    return sliding
