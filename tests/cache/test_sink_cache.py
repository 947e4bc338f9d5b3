"""The sink cache alone, on synthetic keys: geometry, precision over a million tokens, cost, failures.

The test plays the model (tests/cache/players.py): each token has a known key before
RoPE, which the player rotates once at the position the cache hands out, and the token's
identity rides in its value, so the test reads which token each visible slot holds
without asking the cache.

A key has the exact in-cache geometry when its rotary distance to the pass's last
query equals its distance in the cache the paper describes (sinks, then the window,
then the new tokens, contiguous). Only distances matter to attention, so the expected
key is the raw key rotated once in float64 to (query position - that distance).
"""

import dataclasses
import random

import pytest
import torch

from streamchat.cache import LayerSpec, SinkCache
from streamchat.errors import CacheConfigError, CacheStateError
from tests.cache.players import HEAD_DIM, HEADS, INV_FREQ, UNIT_ROUNDOFF, Player


def test_positions_are_exact_in_float32_after_many_evictions():
    player = Player(sinks=4, window=60, dtype=torch.float32)
    player.feed(30)
    for count in [1] * 500 + [7, 60, 1, 33] * 20:
        returned, position = player.feed(count)
        assert player.worst_error(returned, position) < 1e-5


def test_decode_passes_are_exact_and_equal_to_eager_passes():
    eager, device = Player(sinks=4, window=60, dtype=torch.bfloat16), Player(sinks=4, window=60, dtype=torch.bfloat16)
    for player in (eager, device):
        player.feed(30)
    for index in range(400):
        count = 9 if index % 97 == 50 else 1
        expected = eager.feed(count)
        got = device.feed(count) if count > 1 else device.decode()
        assert device.worst_error(*got) <= 2 * UNIT_ROUNDOFF[torch.bfloat16]
        for ours, theirs in zip(got[0], expected[0], strict=True):
            assert torch.equal(ours, theirs)
        assert got[1] == expected[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_million_tokens_drift_no_more_than_two_roundings(dtype):
    player = Player(sinks=4, window=60, dtype=dtype)
    rng = random.Random(7)
    worst, highest_position = 0.0, 0
    while player.seen < 1_000_000:
        count = 1 if rng.random() < 0.25 else rng.randint(30, 60)
        returned, position = player.feed(count)
        highest_position = max(highest_position, position)
        if player.seen % 97 == 0 or player.seen > 999_000:
            worst = max(worst, player.worst_error(returned, position))
    returned, position = player.decode()
    worst = max(worst, player.worst_error(returned, position))
    assert worst <= 2 * UNIT_ROUNDOFF[dtype]
    # Positions stay small (fp32 rotary angles stay precise) however long the stream.
    assert highest_position < player.cache.ledger.rebase_at + 60
    assert player.cache.stats().evicted == player.seen - 64


@pytest.mark.parametrize(("layout", "rotary_dim"), [("interleaved", HEAD_DIM), ("rotate_half", 16)])
def test_other_rotary_layouts_keep_exact_geometry(layout, rotary_dim):
    player = Player(sinks=4, window=40, dtype=torch.bfloat16, layout=layout, rotary_dim=rotary_dim)
    player.feed(20)
    for count in [1] * 300 + [13] * 40:
        returned, position = player.feed(count) if count > 1 else player.decode()
        assert player.worst_error(returned, position) <= 2 * UNIT_ROUNDOFF[torch.bfloat16]


def test_storage_is_allocated_once_and_passes_return_views_of_it():
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(40)
    layer = player.cache.layers[0]
    storage = layer.keys.data_ptr()
    for _ in range(300):
        player.decode()
        assert layer.keys.data_ptr() == storage
    assert layer.keys.shape[2] == 4 + 61  # the sinks, then one slot more than the window


def test_a_decode_pass_writes_its_slot_and_the_sinks_and_nothing_else():
    player = Player(sinks=4, window=2000, dtype=torch.bfloat16)
    for _ in range(3):
        player.feed(1000)
    layer = player.cache.layers[0]
    for _ in range(20):
        keys, values = layer.keys.clone(), layer.values.clone()
        write = player.cache.ledger.sinks + player.cache.ledger.ring.next_slot
        player.decode()
        changed = ((layer.keys != keys) | (layer.values != values)).any(dim=-1).any(dim=1)[0].nonzero().flatten()
        assert set(changed.tolist()) <= {0, 1, 2, 3, write}


def test_evictions_are_reported_with_stream_indices_and_occupancy():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(14)
    first = player.cache.evict_for_space(3)
    player.feed(3)
    second = player.cache.evict_for_space(2)
    assert [(e.count, e.first_index, e.last_index) for e in (first, second)] == [(3, 4, 6), (2, 7, 8)]
    assert second.stats.used == 12 and second.stats.evicted == 5
    stats = player.cache.stats()
    assert (stats.sinks_held, stats.window_used, stats.capacity, stats.seen, stats.evicted) == (4, 8, 14, 17, 5)


def test_reset_forgets_everything():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(14)
    player.feed(5)
    player.cache.reset()
    assert player.cache.stats().used == 0 and player.cache.get_seq_length() == 0
    player.seen = 0
    returned, position = player.feed(6)
    assert player.worst_error(returned, position) < 1e-6


def test_each_pass_returns_exactly_the_eviction_the_ledger_made_for_it():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(14)
    assert player.eviction is None  # it fit
    evictions = []
    for count in [3, 1, 1, 10, 1]:
        ledger = player.cache.ledger.copy()
        expected = ledger.evict(ledger.overflow(count))
        player.feed(count) if count > 1 else player.decode()
        # Stream indices and occupancy alike; the cache adds the ids of the tokens that left, from its record.
        assert dataclasses.replace(player.eviction, token_ids=()) == expected
        assert len(player.eviction.token_ids) == expected.count
        evictions.append(player.eviction)
    assert [(e.count, e.first_index, e.last_index) for e in evictions] == [
        (3, 4, 6),
        (1, 7, 7),
        (1, 8, 8),
        (10, 9, 18),
        (1, 19, 19),
    ]
    assert player.cache.stats().evicted == 16


def test_a_forward_pass_that_raises_leaves_the_cache_torn_until_reset():
    spec = LayerSpec(INV_FREQ.float())
    cache = SinkCache([spec, spec], sinks=2, window=8)
    keys = torch.zeros(1, HEADS, 1, HEAD_DIM)
    token = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="the model failed"), cache.forward_pass(token):
        cache.update(keys, keys, 0)
        raise RuntimeError("the model failed")  # layer 1 never runs: the pass stopped half way
    assert not cache.is_consistent()
    with pytest.raises(CacheStateError, match="forward pass stopped half way"), cache.forward_pass(token):
        pass
    cache.reset()
    with cache.forward_pass(token):
        cache.update(keys, keys, 0)
        cache.update(keys, keys, 1)
    assert cache.is_consistent() and cache.stats().seen == 1


def test_a_decode_pass_that_raises_leaves_the_cache_torn():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(14)
    with pytest.raises(RuntimeError, match="the model failed"), player.cache.decode_pass():
        raise RuntimeError("the model failed")
    assert not player.cache.is_consistent()
    with pytest.raises(CacheStateError, match="forward pass stopped half way"):
        player.decode()


def test_a_decode_pass_before_the_sinks_are_full_is_refused_with_the_way_out():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(3)
    with pytest.raises(CacheStateError, match=r"needs the sinks filled first; feed through cache\.forward_pass"):
        player.decode()
    assert player.cache.is_consistent() and player.cache.stats().seen == 3


def test_a_model_called_outside_a_pass_of_the_cache_is_refused_with_the_way_out():
    cache = SinkCache([LayerSpec(INV_FREQ.float())], sinks=2, window=8)
    keys = torch.zeros(1, HEADS, 1, HEAD_DIM)
    with pytest.raises(CacheStateError, match=r"call the model through cache\.feeding"):
        cache.update(keys, keys, 0)


def test_passes_longer_than_the_window_are_refused():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(4)
    with pytest.raises(CacheConfigError, match="feed at most 10 at a time"):
        player.feed(11)
