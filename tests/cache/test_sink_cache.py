"""The sink cache alone, on synthetic keys: geometry, precision over a million tokens, cost, snapshots.

Token t has a known key before RoPE (`raw_key(t)`, float64). The test plays the model:
it takes each step through the cache (`with cache.step(ids)`, or `with cache.decode_step()`
and decode_inputs), rotates the key once at the position the cache hands out, rounds it to the storage
dtype, and feeds it. Token identities ride in the values (base-16 digits: exact in any
dtype), so the test reads which token each slot the last query may see holds, without
asking the cache.

A key has the exact in-cache geometry when its rotary distance to the step's last
query equals its distance in the cache the paper describes (sinks, then the window,
then the new tokens, contiguous). Only distances matter to attention, so the expected
key is the raw key rotated once in float64 to (query position - that distance).
"""

import dataclasses
import random

import pytest
import torch

from streamchat.cache import LayerSpec, SinkCache
from streamchat.cache.snapshots import Checkpoint, ReplySnapshot, cache_state, load_cache_state, release_snapshots
from streamchat.errors import CacheConfigError, CacheStateError

HEADS, HEAD_DIM = 2, 64
INV_FREQ = 1.0 / (1e5 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def raw_key(tokens: torch.Tensor) -> torch.Tensor:
    """A deterministic, varied key [heads, n, head_dim] per token, before RoPE: a hash in [-1, 1)."""
    t = tokens[None, :, None]
    head = torch.arange(HEADS)[:, None, None]
    dim = torch.arange(HEAD_DIM)[None, None, :]
    hashed = (t * 2654435761 + head * 40503 + dim * 7919) % 65521
    return hashed.double() / 32760.5 - 1.0


def encode_tokens(tokens: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Token indices as five base-16 digits [n, 5], exact in any dtype."""
    digits = torch.stack([(tokens // 16**place) % 16 for place in range(5)], dim=-1)
    return digits.to(dtype)


def decode_tokens(digits: torch.Tensor) -> torch.Tensor:
    return sum(digits[..., place].long() * 16**place for place in range(5))


class Rope:
    """Keys [heads, n, dim] rotated at positions [n] in float64, independent of streamchat.cache.rope.

    cos and sin are tabulated over the positions a bounded cache can use; the cache
    keeps positions small, so a position off the table fails the test.
    """

    LOWEST, HIGHEST = -1024, 16384

    def __init__(self, layout: str, inv_freq: torch.Tensor):
        self.layout = layout
        self.rotary_dim = 2 * inv_freq.numel()
        angles = torch.arange(self.LOWEST, self.HIGHEST, dtype=torch.float64)[:, None] * inv_freq.double()
        self.cos, self.sin = angles.cos(), angles.sin()

    def __call__(self, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions - self.LOWEST], self.sin[positions - self.LOWEST]
        rot, rest = keys[..., : self.rotary_dim], keys[..., self.rotary_dim :]
        if self.layout == "interleaved":
            even, odd = rot[..., 0::2], rot[..., 1::2]
            rot = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
        else:
            first, second = rot.chunk(2, dim=-1)
            rot = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
        return torch.cat((rot, rest), dim=-1)


class Player:
    """Feeds tokens to a one-layer cache the way a model would."""

    def __init__(self, sinks, window, dtype, layout="rotate_half", rotary_dim=HEAD_DIM):
        # Float32 frequencies, as a model keeps them; the truth uses the very same values.
        inv_freq = INV_FREQ[: rotary_dim // 2].float()
        self.cache = SinkCache([LayerSpec(inv_freq, layout)], sinks=sinks, window=window)
        self.rope = Rope(layout, inv_freq)
        self.dtype = dtype
        self.seen = 0
        self.eviction = None  # what the last step evicted

    def feed(self, count: int):
        """Feed the next `count` tokens in one eager step; return what the last query sees, and its position."""
        with self.cache.step(torch.arange(self.seen, self.seen + count)[None]) as step:
            self.eviction = step.eviction
            return self._write(count, step.inputs)

    def decode(self):
        """Feed the next token through the device-only decode step."""
        with self.cache.decode_step() as eviction:
            self.eviction = eviction
            return self._write(1, self.cache.decode_inputs(torch.tensor([[self.seen]])))

    def _write(self, count: int, inputs):
        tokens = torch.arange(self.seen, self.seen + count)
        positions = inputs.position_ids[0]
        keys = self.rope(raw_key(tokens), positions).to(self.dtype)[None]
        values = torch.zeros(1, HEADS, count, HEAD_DIM, dtype=self.dtype)
        values[..., :5] = encode_tokens(tokens, self.dtype)
        keys, values = self.cache.update(keys, values, 0)
        self.seen += count
        visible = inputs.attention_mask[0, 0, -1]
        return (keys[:, :, visible], values[:, :, visible]), positions[-1].item()

    def worst_error(self, returned, last_position: int) -> float:
        """Largest relative error of a visible key against the exact in-cache geometry."""
        keys, values = returned
        tokens = decode_tokens(values[0, 0, :, :5])
        assert sorted(tokens.tolist()) == self.expected_tokens()
        last_token, sinks = self.seen - 1, self.cache.sinks
        # In-cache distance to the last query: sinks sit right before the oldest window token.
        oldest_window = tokens[tokens >= sinks].min().item() if (tokens >= sinks).any() else last_token
        sink_distance = (last_token - oldest_window) + (sinks - tokens)
        distance = torch.where(tokens < sinks, sink_distance, last_token - tokens)
        expected = self.rope(raw_key(tokens), last_position - distance)
        error = (keys[0].double() - expected).norm(dim=-1) / expected.norm(dim=-1)
        return error.max().item()

    def expected_tokens(self) -> list[int]:
        sinks, window = self.cache.sinks, self.cache.window
        return list(range(min(self.seen, sinks))) + list(range(max(sinks, self.seen - window), self.seen))


def test_positions_are_exact_in_float32_after_many_evictions():
    player = Player(sinks=4, window=60, dtype=torch.float32)
    player.feed(30)
    for count in [1] * 500 + [7, 60, 1, 33] * 20:
        returned, position = player.feed(count)
        assert player.worst_error(returned, position) < 1e-5


def test_decode_steps_are_exact_and_equal_to_eager_steps():
    eager, device = Player(sinks=4, window=60, dtype=torch.bfloat16), Player(sinks=4, window=60, dtype=torch.bfloat16)
    for player in (eager, device):
        player.feed(30)
    for step in range(400):
        count = 9 if step % 97 == 50 else 1
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


def test_storage_is_allocated_once_and_steps_return_views_of_it():
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(40)
    layer = player.cache.layers[0]
    storage = layer.keys.data_ptr()
    for _ in range(300):
        player.decode()
        assert layer.keys.data_ptr() == storage
    assert layer.keys.shape[2] == 4 + 61  # the sinks, then one slot more than the window


def test_a_decode_step_writes_its_slot_and_the_sinks_and_nothing_else():
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


def _play(player: Player, counts: list[int]) -> list:
    return [player.feed(count) if count > 1 else player.decode() for count in counts]


@pytest.mark.parametrize("budget", [40, 100])
def test_restore_takes_back_everything_the_budget_covers_even_past_a_rebase(budget):
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(60)
    player.feed(50)  # positions 110 of a rebase due at 124
    snapshot, seen = ReplySnapshot.take(player.cache, budget), player.seen
    counts = [1] * (budget - 7) + [7]  # the reply: tokens one by one, then its closing
    first = _play(player, counts)
    snapshot.restore(player.cache)
    player.seen = seen
    assert player.cache.stats().used == 64 and player.cache.stats().seen == 110
    again = _play(player, counts)
    for (returned, position), (returned_again, position_again) in zip(first, again, strict=True):
        assert position == position_again
        assert all(torch.equal(a, b) for a, b in zip(returned, returned_again, strict=True))
    # Only what the reply could overwrite was saved: the sinks and `budget` ring slots, unless that is all of them.
    saved_slots = 4 + min(budget, 61)
    assert snapshot.nbytes == saved_slots * 2 * HEADS * HEAD_DIM * 2 + 2 * (HEADS * 4 * HEAD_DIM * 4)


def test_a_partial_snapshot_holds_rebases_until_it_is_released():
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(60)
    player.feed(60)
    ReplySnapshot.take(player.cache, 40)
    _play(player, [1] * 30)
    assert player.cache.get_seq_length() > player.cache.ledger.rebase_at  # held
    release_snapshots(player.cache)
    returned, position = player.decode()
    assert position < player.cache.ledger.rebase_at
    assert player.worst_error(returned, position) <= 2 * UNIT_ROUNDOFF[torch.bfloat16]


def test_rolling_back_a_decode_step_is_exact():
    taken_back, straight = Player(4, 30, torch.bfloat16), Player(4, 30, torch.bfloat16)
    for player in (taken_back, straight):
        player.feed(30)
        _play(player, [1] * 20)
    checkpoint = Checkpoint.take(taken_back.cache)
    taken_back.decode()
    checkpoint.restore(taken_back.cache)
    taken_back.seen -= 1
    for (ours, position), (theirs, their_position) in zip(
        _play(taken_back, [1, 1, 5]), _play(straight, [1, 1, 5]), strict=True
    ):
        assert position == their_position and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_each_step_returns_exactly_the_eviction_the_ledger_made_for_it():
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
    with pytest.raises(RuntimeError, match="the model failed"), cache.step(token):
        cache.update(keys, keys, 0)
        raise RuntimeError("the model failed")  # layer 1 never runs: the pass stopped half way
    assert not cache.is_consistent()
    with pytest.raises(CacheStateError, match="forward pass stopped half way"), cache.step(token):
        pass
    cache.reset()
    with cache.step(token):
        cache.update(keys, keys, 0)
        cache.update(keys, keys, 1)
    assert cache.is_consistent() and cache.stats().seen == 1


def test_a_decode_step_that_raises_leaves_the_cache_torn():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(14)
    with pytest.raises(RuntimeError, match="the model failed"), player.cache.decode_step():
        raise RuntimeError("the model failed")
    assert not player.cache.is_consistent()
    with pytest.raises(CacheStateError, match="forward pass stopped half way"):
        player.decode()


def test_a_decode_step_before_the_sinks_are_full_is_refused_with_the_way_out():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(3)
    with pytest.raises(CacheStateError, match=r"needs the sinks filled first; feed through cache\.step"):
        player.decode()
    assert player.cache.is_consistent() and player.cache.stats().seen == 3


def test_a_model_called_without_the_cache_s_step_is_refused_with_the_way_out():
    cache = SinkCache([LayerSpec(INV_FREQ.float())], sinks=2, window=8)
    keys = torch.zeros(1, HEADS, 1, HEAD_DIM)
    with pytest.raises(CacheStateError, match=r"call the model through cache\.feeding"):
        cache.update(keys, keys, 0)


def test_steps_longer_than_the_window_are_refused():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(4)
    with pytest.raises(CacheConfigError, match="feed at most 10 at a time"):
        player.feed(11)


def test_the_whole_state_saved_and_loaded_into_a_new_cache_continues_exactly():
    saved, straight = Player(4, 30, torch.bfloat16), Player(4, 30, torch.bfloat16)
    for player in (saved, straight):
        player.feed(30)
        _play(player, [1] * 45 + [6])
    state = {name: tensor.clone() for name, tensor in cache_state(saved.cache).items()}
    resumed = Player(4, 30, torch.bfloat16)
    load_cache_state(resumed.cache, state)
    resumed.seen = saved.seen
    assert resumed.cache.stats() == straight.cache.stats()
    for (ours, position), (theirs, their_position) in zip(
        _play(resumed, [1] * 50 + [5]), _play(straight, [1] * 50 + [5]), strict=True
    ):
        assert position == their_position and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_state_holds_only_the_slots_written_and_a_loaded_one_continues_exactly_in_a_used_cache():
    saved, straight, used = Player(4, 30, torch.float32), Player(4, 30, torch.float32), Player(4, 30, torch.float32)
    for player in (saved, straight):
        player.feed(10)
        _play(player, [1] * 5)
    _play(used, [20] + [1] * 40)  # a cache that held another stream: every slot written
    state = cache_state(saved.cache)
    assert state["layers.0.keys"].shape == (1, HEADS, 4 + 11, HEAD_DIM)  # the sinks and 11 ring slots written
    load_cache_state(used.cache, state)
    used.seen = saved.seen
    assert torch.equal(used.cache.layers[0].keys, straight.cache.layers[0].keys)
    for (ours, position), (theirs, their_position) in zip(
        _play(used, [1] * 40 + [3]), _play(straight, [1] * 40 + [3]), strict=True
    ):
        assert position == their_position and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_a_state_saved_from_another_shape_is_refused():
    player = Player(4, 30, torch.bfloat16)
    player.feed(10)
    with pytest.raises(CacheStateError, match=r"saved cache is 4 sinks \+ 30 window .* this one is 4 \+ 40"):
        load_cache_state(Player(4, 40, torch.bfloat16).cache, cache_state(player.cache))
