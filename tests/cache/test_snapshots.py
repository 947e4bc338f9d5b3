"""Snapshots of a sink cache: taking back a decode pass, a reply (/regen), and the whole state saved and read back."""

import pytest
import torch

from streamchat.cache.snapshots import CacheSnapshot, release_snapshots
from streamchat.errors import CacheStateError
from tests.cache.players import HEAD_DIM, HEADS, UNIT_ROUNDOFF, Player, play


@pytest.mark.parametrize("budget", [40, 100])
def test_restore_takes_back_everything_the_budget_covers_even_past_a_rebase(budget):
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(60)
    player.feed(50)  # positions 110 of a rebase due at 124
    snapshot, seen = CacheSnapshot.take(player.cache, reach=budget), player.seen
    counts = [1] * (budget - 7) + [7]  # the reply: tokens one by one, then its closing
    first = play(player, counts)
    snapshot.restore(player.cache)
    player.seen = seen
    assert player.cache.stats().used == 64 and player.cache.stats().seen == 110
    again = play(player, counts)
    for (returned, position), (returned_again, position_again) in zip(first, again, strict=True):
        assert position == position_again
        assert all(torch.equal(a, b) for a, b in zip(returned, returned_again, strict=True))
    # Only what the reply could overwrite was saved: the sinks and `budget` ring slots, unless that is all of them,
    # keys and values in bfloat16, and the pristine sinks in float32 (their partners are computed from them).
    saved_slots = 4 + min(budget, 61)
    assert snapshot.nbytes == saved_slots * 2 * HEADS * HEAD_DIM * 2 + HEADS * 4 * HEAD_DIM * 4


def test_a_partial_snapshot_holds_rebases_until_it_is_released():
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(60)
    player.feed(60)
    CacheSnapshot.take(player.cache, reach=40)
    play(player, [1] * 30)
    assert player.cache.get_seq_length() > player.cache.ledger.rebase_at  # held
    release_snapshots(player.cache)
    returned, position = player.decode()
    assert position < player.cache.ledger.rebase_at
    assert player.worst_error(returned, position) <= 2 * UNIT_ROUNDOFF[torch.bfloat16]


def test_rolling_back_a_decode_pass_is_exact():
    taken_back, straight = Player(4, 30, torch.bfloat16), Player(4, 30, torch.bfloat16)
    for player in (taken_back, straight):
        player.feed(30)
        play(player, [1] * 20)
    checkpoint = CacheSnapshot.take(taken_back.cache)
    taken_back.decode()
    checkpoint.restore(taken_back.cache)
    taken_back.seen -= 1
    for (ours, position), (theirs, their_position) in zip(
        play(taken_back, [1, 1, 5]), play(straight, [1, 1, 5]), strict=True
    ):
        assert position == their_position and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_the_whole_state_saved_and_loaded_into_a_new_cache_continues_exactly():
    saved, straight = Player(4, 30, torch.bfloat16), Player(4, 30, torch.bfloat16)
    for player in (saved, straight):
        player.feed(30)
        play(player, [1] * 45 + [6])
    state = {name: tensor.clone() for name, tensor in CacheSnapshot.whole(saved.cache).tensors().items()}
    resumed = Player(4, 30, torch.bfloat16)
    CacheSnapshot.from_tensors(state, resumed.cache).restore(resumed.cache)
    resumed.seen = saved.seen
    assert resumed.cache.stats() == straight.cache.stats()
    for (ours, position), (theirs, their_position) in zip(
        play(resumed, [1] * 50 + [5]), play(straight, [1] * 50 + [5]), strict=True
    ):
        assert position == their_position and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_state_holds_only_the_slots_written_and_a_loaded_one_continues_exactly_in_a_used_cache():
    saved, straight, used = Player(4, 30, torch.float32), Player(4, 30, torch.float32), Player(4, 30, torch.float32)
    for player in (saved, straight):
        player.feed(10)
        play(player, [1] * 5)
    play(used, [20] + [1] * 40)  # a cache that held another stream: every slot written
    state = CacheSnapshot.whole(saved.cache).tensors()
    assert state["layers.0.keys"].shape == (1, HEADS, 4 + 11, HEAD_DIM)  # the sinks and 11 ring slots written
    CacheSnapshot.from_tensors(state, used.cache).restore(used.cache)
    used.seen = saved.seen
    assert torch.equal(used.cache.layers[0].keys, straight.cache.layers[0].keys)
    for (ours, position), (theirs, their_position) in zip(
        play(used, [1] * 40 + [3]), play(straight, [1] * 40 + [3]), strict=True
    ):
        assert position == their_position and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_state_saved_from_another_shape_is_refused():
    player = Player(4, 30, torch.bfloat16)
    player.feed(10)
    with pytest.raises(CacheStateError, match=r"saved cache is 4 sinks \+ 30 window .* this one is 4 \+ 40"):
        CacheSnapshot.from_tensors(CacheSnapshot.whole(player.cache).tensors(), Player(4, 40, torch.bfloat16).cache)


def test_a_decode_pass_s_snapshot_keeps_only_the_bookkeeping():
    player = Player(4, 30, torch.bfloat16)
    player.feed(30)
    snapshot = CacheSnapshot.take(player.cache)
    assert snapshot.slots is None and snapshot.nbytes == 0
    with pytest.raises(CacheStateError, match=r"only a whole snapshot"):
        snapshot.tensors()
    with pytest.raises(CacheStateError, match=r"only a whole snapshot"):
        CacheSnapshot.take(player.cache, reach=5).tensors()


@pytest.mark.parametrize(
    ("name", "tampered"),
    [
        ("layers.0.keys", lambda keys: keys[..., : HEAD_DIM // 2]),  # another head size
        ("layers.0.keys", lambda keys: keys[:, :, :-1]),  # fewer slots than its ledger wrote
        ("layers.0.values", lambda values: values[:, :1]),  # another head count
        ("layers.0.pristine_sinks", lambda sinks: sinks[:, :, :2]),  # fewer sinks
    ],
)
def test_a_state_that_does_not_fit_is_refused_before_the_cache_is_written(name, tampered):
    saved, used = Player(4, 30, torch.float32), Player(4, 30, torch.float32)
    saved.feed(12)
    play(used, [20] + [1] * 5)
    state = CacheSnapshot.whole(saved.cache).tensors()
    state[name] = tampered(state[name])
    before = CacheSnapshot.whole(used.cache).tensors()
    with pytest.raises(CacheStateError, match=r"layer 0"):
        CacheSnapshot.from_tensors(state, used.cache)
    after = CacheSnapshot.whole(used.cache).tensors()
    assert before.keys() == after.keys() and all(torch.equal(before[key], after[key]) for key in before)
