import itertools

import pytest

from streamchat.cache.ledger import CacheStats, Eviction, Ring, SlidingLedger, StreamLedger
from streamchat.errors import CacheConfigError


def test_ring_push_wraps_into_two_runs():
    ring = Ring(capacity=4, head=3, length=1)  # five slots
    assert ring.push(3) == ((4, 5), (0, 2))
    assert ring.length == 4 and ring.extent == 5


def test_ring_pop_advances_head_modulo_its_slots_and_returns_them():
    ring = Ring(capacity=4, head=4, length=4)
    assert ring.pop(2) == ((4, 5), (0, 1))
    assert (ring.head, ring.length) == (1, 2)


def test_a_full_ring_always_has_one_free_slot_to_write():
    ring = Ring(capacity=3)
    ring.push(3)
    for _ in range(10):
        free = ring.next_slot
        assert free not in {slot for start, stop in ring.held() for slot in range(start, stop)}
        ring.pop(1)
        assert ring.push(1) == ((free, free + 1),)


@pytest.mark.parametrize(
    ("sinks", "window", "message"),
    [
        (-1, 10, "sinks=-1: must be a whole number >= 0"),
        (4, 0, "window=0: must be a whole number >= 1 (a decode pass needs one slot)"),
        (4, -5, "window=-5"),
        (2.5, 10, "sinks=2.5"),
        (True, 10, "sinks=True"),
    ],
)
def test_invalid_sizes_are_refused_by_name(sinks, window, message):
    with pytest.raises(CacheConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StreamLedger(sinks, window)


def test_a_pass_longer_than_the_window_is_refused():
    ledger = StreamLedger(sinks=4, window=10)
    with pytest.raises(CacheConfigError, match="15 tokens in one pass do not fit a window of 10"):
        ledger.place(15)


def test_the_first_tokens_fill_the_sinks_then_the_window():
    ledger = StreamLedger(sinks=4, window=10)
    placement = ledger.place(6)
    assert placement.sink_slots == (0, 4)
    assert placement.window_runs == ((0, 2),)
    assert placement.first_position == 0 and placement.sink_shift == 0 and placement.extent == 6
    assert ledger.stats() == CacheStats(4, 4, 2, 10, seen=6, evicted=0)


def test_a_full_window_evicts_exactly_what_the_pass_needs():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.place(14)
    assert ledger.overflow(3) == 3
    assert ledger.evict(3) == Eviction(
        count=3, first_index=4, last_index=6, stats=CacheStats(4, 4, 7, 10, seen=14, evicted=3)
    )
    placement = ledger.place(3)
    assert placement.window_runs == ((10, 11), (0, 2))  # the spare slot, then the slots just freed
    assert ledger.used == 14
    assert placement.sink_shift == 3  # the window now starts at position 7, right after sinks at 3..6


def test_a_pass_without_room_is_refused():
    ledger = StreamLedger(sinks=2, window=4)
    ledger.place(6)
    with pytest.raises(CacheConfigError, match=r"no room for 1 tokens: evict_for_space\(1\) first"):
        ledger.place(1)


def test_window_tokens_keep_their_slot_for_life():
    ledger = StreamLedger(sinks=2, window=4)
    ledger.place(2)
    slot_of = {}
    for token in range(2, 40):
        ledger.evict(ledger.overflow(1))
        ((start, _),) = ledger.place(1).window_runs
        slot_of[token] = start
    assert all(slot == (token - 2) % 5 for token, slot in slot_of.items())


def test_eviction_indices_follow_the_stream():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.place(14)
    assert ledger.evict(2) == Eviction(2, 4, 5, CacheStats(4, 4, 8, 10, seen=14, evicted=2))
    assert ledger.evict(0) is None
    assert ledger.evict(3).first_index == 6


def test_evicting_more_than_the_window_holds_is_refused():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.place(5)
    with pytest.raises(CacheConfigError, match="cannot evict 2 tokens from a window holding 1"):
        ledger.evict(2)


def test_positions_rebase_at_most_once_per_window():
    ledger = StreamLedger(sinks=4, window=10)
    rebases = []
    for _ in range(200):
        if ledger.rebase_due:
            rebases.append((ledger.seen, ledger.rebase()))
            assert ledger.sink_shift == 0
            assert ledger.next_position == ledger.used
        ledger.evict(ledger.overflow(1))
        ledger.place(1)
        assert ledger.next_position < ledger.rebase_at + 1
        assert 0 <= ledger.sink_shift <= ledger.max_shift
    assert rebases[0] == (24, 10)
    gaps = {later - earlier for (earlier, _), (later, _) in itertools.pairwise(rebases)}
    assert gaps == {10}


def test_a_held_rebase_waits_and_the_shift_stays_within_max_shift():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.rebase_held = True
    for _ in range(ledger.ring.slots + 30):
        assert not ledger.rebase_due
        ledger.evict(ledger.overflow(1))
        ledger.place(1)
        if ledger.next_position >= ledger.rebase_at + ledger.ring.slots:
            break
        assert ledger.sink_shift <= ledger.max_shift
    ledger.rebase_held = False
    assert ledger.rebase_due


def test_copies_are_independent():
    ledger = StreamLedger(sinks=2, window=4)
    ledger.place(5)
    clone = ledger.copy()
    ledger.evict(2)
    ledger.place(2)
    assert (clone.ring.head, clone.ring.length, clone.seen) == (0, 3, 5)


def test_sliding_ledger_keeps_the_last_window_minus_one_for_new_queries():
    sliding = SlidingLedger(sliding_window=4)
    first = sliding.place(6)
    assert (first.kept, first.stored_from, first.runs) == ((), 2, ((0, 4),))
    decode = sliding.place(1)  # the query sees the three before it and itself
    assert decode.runs == ((4, 5),) and decode.freed == ((0, 1),) and sliding.ring.length == 4
    chunk = sliding.place(3)
    assert chunk.kept == ((2, 5),)  # oldest first: the tokens the three new queries still see
    assert chunk.freed == ((1, 4),) and chunk.runs == ((0, 3),)  # the three oldest go, the new take slots 0-2
    assert (sliding.ring.head, sliding.ring.length) == (4, 4)
