import itertools

import pytest

from streamchat.cache.ledger import CacheStats, Eviction, Ring, SlidingLedger, StreamLedger
from streamchat.errors import CacheConfigError


def test_ring_push_wraps_into_two_runs():
    ring = Ring(capacity=5, head=3, length=1)
    assert ring.push(3) == ((4, 5), (0, 2))
    assert ring.length == 4


def test_ring_pop_advances_head_modulo_capacity():
    ring = Ring(capacity=5, head=4, length=5)
    ring.pop(2)
    assert (ring.head, ring.length) == (1, 3)


def test_ring_reorder_reports_the_roll():
    ring = Ring(capacity=5, head=3, length=5)
    assert ring.reorder() == 3
    assert ring.head == 0


@pytest.mark.parametrize(
    ("sinks", "window", "message"),
    [
        (-1, 10, "sinks=-1: must be a whole number >= 0"),
        (4, 0, "window=0: must be a whole number >= 1 (a decode step needs one slot)"),
        (4, -5, "window=-5"),
        (2.5, 10, "sinks=2.5"),
        (True, 10, "sinks=True"),
    ],
)
def test_invalid_sizes_are_refused_by_name(sinks, window, message):
    with pytest.raises(CacheConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        StreamLedger(sinks, window)


def test_a_step_longer_than_the_window_is_refused():
    ledger = StreamLedger(sinks=4, window=10)
    with pytest.raises(CacheConfigError, match="15 tokens in one step do not fit a window of 10"):
        ledger.step(15)


def test_the_first_tokens_fill_the_sinks_then_the_window():
    ledger = StreamLedger(sinks=4, window=10)
    step = ledger.step(6)
    assert step.sink_slots == (0, 4)
    assert step.window_runs == ((0, 2),)
    assert step.used == 6 and step.eviction is None and step.sink_shift == 0
    assert ledger.stats() == CacheStats(4, 4, 2, 10, seen=6, evicted=0)


def test_a_full_window_evicts_exactly_what_the_step_needs():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.step(14)
    step = ledger.step(3)
    assert step.eviction == Eviction(
        count=3, first_index=4, last_index=6, stats=CacheStats(4, 4, 7, 10, seen=14, evicted=3)
    )
    assert step.used == 14
    assert step.sink_shift == 3  # the window now starts at position 7, right after sinks at 3..6
    assert ledger.stats().evicted == 3


def test_decode_steps_into_a_full_ring_never_reorder():
    ledger = StreamLedger(sinks=2, window=4)
    ledger.step(6)
    rolls = [ledger.step(1).roll for _ in range(7)]
    assert rolls == [0] * 7
    assert ledger.ring.head == 3


def test_longer_steps_leave_slots_in_age_order():
    ledger = StreamLedger(sinks=2, window=4)
    ledger.step(6)
    ledger.step(1)  # head moves to 1
    step = ledger.step(2)  # writes slots 1, 2 then rolls the window by head
    assert step.window_runs == ((1, 3),)
    assert step.roll == 3
    assert ledger.ring.head == 0


def test_a_ring_left_partly_empty_is_reordered_before_decoding():
    ledger = StreamLedger(sinks=2, window=6)
    ledger.step(8)
    ledger.evict(4)  # the paper's per-turn reserve: head 4, two tokens left
    step = ledger.step(1)
    assert step.window_runs == ((0, 1),)
    assert step.roll == 4  # slots 4, 5, 0 hold the three newest: roll them to 0, 1, 2
    assert step.used == 5


def test_eviction_indices_follow_the_stream():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.step(14)
    assert ledger.evict(2) == Eviction(2, 4, 5, CacheStats(4, 4, 8, 10, seen=14, evicted=2))
    assert ledger.evict(0) is None
    assert ledger.evict(3).first_index == 6


def test_evicting_more_than_the_window_holds_is_refused():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.step(5)
    with pytest.raises(CacheConfigError, match="cannot evict 2 tokens from a window holding 1"):
        ledger.evict(2)


def test_mask_sizes_predict_the_step():
    ledger = StreamLedger(sinks=4, window=10)
    ledger.step(14)
    assert ledger.mask_sizes(3) == (14, 3)
    assert ledger.step(3).used == 14


def test_positions_rebase_at_most_once_per_window():
    ledger = StreamLedger(sinks=4, window=10)
    rebases = []
    for _ in range(200):
        if ledger.next_position >= ledger.rebase_at:
            rebases.append((ledger.seen, ledger.rebase()))
            assert ledger.sink_shift == 0
            assert ledger.next_position == ledger.used
        ledger.step(1)
        assert ledger.next_position < ledger.rebase_at + 1
        assert 0 <= ledger.sink_shift <= ledger.max_shift
    assert rebases[0] == (24, 10)
    gaps = {later - earlier for (earlier, _), (later, _) in itertools.pairwise(rebases)}
    assert gaps == {10}


def test_sliding_ledger_keeps_the_last_window_minus_one_for_new_queries():
    sliding = SlidingLedger(sliding_window=4)
    first = sliding.step(6)
    assert (first.kept_slots, first.stored, first.runs) == ((0, 0), 4, ((0, 4),))
    assert sliding.mask_sizes(1) == (4, 0)
    decode = sliding.step(1)
    assert decode.runs == ((0, 1),) and decode.used == 4
    chunk = sliding.step(3)
    assert chunk.roll == 1 and chunk.kept_slots == (1, 4)
    assert chunk.runs == ((0, 3),) and sliding.ring.length == 4
