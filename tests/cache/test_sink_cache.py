"""The sink cache alone, on synthetic keys: geometry, precision over a million tokens, cost, events.

Token t has a known key before RoPE (`raw_key(t)`, float64). The test plays the model:
it rotates the key once at the position the cache hands out, rounds it to the storage
dtype, and feeds it. Token identities ride in the values (base-16 digits: exact in any
dtype), so the test reads which token each returned slot holds without asking the
cache.

A key has the exact in-cache geometry when its rotary distance to the step's last
query equals its distance in the cache the paper describes (sinks, then the window,
then the new tokens, contiguous). Only distances matter to attention, so the expected
key is the raw key rotated once in float64 to (query position - that distance).
"""

import contextlib
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from streamchat.cache import LayerSpec, SinkCache
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

    LOWEST, HIGHEST = -1024, 8192

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

    def __init__(self, sinks, window, dtype, layout="rotate_half", rotary_dim=HEAD_DIM, observer=None):
        # Float32 frequencies, as a model keeps them; the truth uses the very same values.
        inv_freq = INV_FREQ[: rotary_dim // 2].float()
        self.cache = SinkCache([LayerSpec(inv_freq, layout)], sinks=sinks, window=window, observer=observer)
        self.rope = Rope(layout, inv_freq)
        self.dtype = dtype
        self.seen = 0

    def feed(self, count: int, counter: TorchDispatchMode | None = None):
        """Feed the next `count` tokens; return what the cache hands to attention, and their positions."""
        tokens = torch.arange(self.seen, self.seen + count)
        position = self.cache.get_seq_length()
        positions = torch.arange(position, position + count)
        keys = self.rope(raw_key(tokens), positions).to(self.dtype)[None]
        values = torch.zeros(1, HEADS, count, HEAD_DIM, dtype=self.dtype)
        values[..., :5] = encode_tokens(tokens, self.dtype)
        with counter or contextlib.nullcontext():
            returned = self.cache.update(keys, values, 0)
        self.seen += count
        return returned, positions

    def worst_error(self, returned, positions) -> float:
        """Largest relative error of a returned key against the exact in-cache geometry."""
        keys, values = returned
        tokens = decode_tokens(values[0, 0, :, :5])
        last_token, last_position = self.seen - 1, positions[-1].item()
        sinks = self.cache.sinks
        # In-cache distance to the last query: sinks sit right before the oldest window token.
        oldest_window = tokens[sinks:].min().item() if len(tokens) > sinks else last_token
        sink_distance = (last_token - oldest_window) + (sinks - tokens)
        distance = torch.where(tokens < sinks, sink_distance, last_token - tokens)
        expected = self.rope(raw_key(tokens), last_position - distance)
        error = (keys[0].double() - expected).norm(dim=-1) / expected.norm(dim=-1)
        return error.max().item()


def test_positions_are_exact_in_float32_after_many_evictions():
    player = Player(sinks=4, window=60, dtype=torch.float32)
    player.feed(30)
    for count in [1] * 500 + [7, 60, 1, 33] * 20:
        returned, positions = player.feed(count)
        assert player.worst_error(returned, positions) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_million_tokens_drift_no_more_than_two_roundings(dtype):
    player = Player(sinks=4, window=60, dtype=dtype)
    rng = random.Random(7)
    worst, highest_position = 0.0, 0
    while player.seen < 1_000_000:
        count = 1 if rng.random() < 0.25 else rng.randint(30, 60)
        returned, positions = player.feed(count)
        highest_position = max(highest_position, positions[-1].item())
        if player.seen % 97 == 0 or player.seen > 999_000:
            worst = max(worst, player.worst_error(returned, positions))
    returned, positions = player.feed(1)
    worst = max(worst, player.worst_error(returned, positions))
    assert worst <= 2 * UNIT_ROUNDOFF[dtype]
    # Positions stay small (fp32 rotary angles stay precise) however long the stream.
    assert highest_position < player.cache.ledger.rebase_at + 60
    assert player.cache.stats().evicted == player.seen - 64


@pytest.mark.parametrize(("layout", "rotary_dim"), [("interleaved", HEAD_DIM), ("rotate_half", 16)])
def test_other_rotary_layouts_keep_exact_geometry(layout, rotary_dim):
    player = Player(sinks=4, window=40, dtype=torch.bfloat16, layout=layout, rotary_dim=rotary_dim)
    for count in [20] + [1] * 300 + [13] * 40:
        returned, positions = player.feed(count)
        assert player.worst_error(returned, positions) <= 2 * UNIT_ROUNDOFF[torch.bfloat16]


def test_storage_is_allocated_once_and_decode_returns_views_of_it():
    player = Player(sinks=4, window=60, dtype=torch.bfloat16)
    player.feed(40)
    layer = player.cache.layers[0]
    storage = layer.keys.data_ptr()
    for _ in range(500):
        (keys, _), _ = player.feed(1)
        assert keys.data_ptr() == layer.keys.data_ptr() == storage
        assert keys.shape[2] == min(player.seen, 64)


class _CountWrites(TorchDispatchMode):
    """Counts the tensor elements that operations write: fresh results and in-place targets, not views."""

    def __init__(self):
        super().__init__()
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else [out]
        for returned, tensor in zip(func._schema.returns, outputs, strict=False):
            alias = returned.alias_info
            if isinstance(tensor, torch.Tensor) and (alias is None or alias.is_write):
                self.written += tensor.numel()
        return out


def _decode_cost(player: Player, steps: int) -> list[int]:
    costs = []
    for _ in range(steps):
        if player.cache.ledger.next_position + 1 >= player.cache.ledger.rebase_at:
            player.feed(1)  # the rare rebase step, measured separately
            continue
        counter = _CountWrites()
        player.feed(1, counter)
        costs.append(counter.written)
    return costs


def test_a_decode_step_costs_the_same_early_and_late_and_does_not_touch_the_window():
    player = Player(sinks=4, window=2000, dtype=torch.bfloat16)
    for _ in range(3):
        player.feed(1000)
    early = _decode_cost(player, 20)
    while player.seen < 100_000:
        player.feed(2000)
    late = _decode_cost(player, 20)
    assert set(early) == set(late) and len(set(late)) == 1
    # Writing one token plus rotating four sinks: a small multiple of sinks * heads * head_dim,
    # far below one pass over the window (2000 * heads * head_dim).
    assert late[0] < 40 * HEADS * HEAD_DIM


def test_evictions_are_reported_with_stream_indices_and_occupancy():
    seen = []
    player = Player(sinks=4, window=10, dtype=torch.float32, observer=seen.append)
    player.feed(14)
    player.feed(3)
    explicit = player.cache.evict_for_space(2)
    assert [(e.count, e.first_index, e.last_index) for e in seen] == [(3, 4, 6), (2, 7, 8)]
    assert explicit is seen[-1]
    assert explicit.stats.used == 12 and explicit.stats.evicted == 5
    stats = player.cache.stats()
    held = (stats.sinks_held, stats.window_used, stats.capacity, stats.seen, stats.evicted)
    assert held == (4, 8, 14, 17, 5)


def test_reset_forgets_everything():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(14)
    player.feed(5)
    player.cache.reset()
    assert player.cache.stats().used == 0 and player.cache.get_seq_length() == 0
    player.seen = 0
    returned, positions = player.feed(6)
    assert player.worst_error(returned, positions) < 1e-6


def test_restore_returns_to_the_snapshot_exactly_even_after_evictions_and_a_rebase():
    player = Player(sinks=4, window=10, dtype=torch.bfloat16)
    player.feed(14)
    snapshot, seen = player.cache.snapshot(), player.seen
    first = [player.feed(count)[0] for count in [1] * 30 + [7]]  # passes rebase_at (24)
    player.cache.restore(snapshot)
    player.seen = seen
    assert player.cache.stats().used == 14 and player.cache.stats().seen == 14
    again = [player.feed(count)[0] for count in [1] * 30 + [7]]
    for (keys, values), (keys_again, values_again) in zip(first, again, strict=True):
        assert torch.equal(keys, keys_again) and torch.equal(values, values_again)


def test_an_interrupted_forward_pass_is_detected():
    spec = LayerSpec(INV_FREQ.float())
    cache = SinkCache([spec, spec], sinks=2, window=8)
    keys = torch.zeros(1, HEADS, 1, HEAD_DIM)
    cache.update(keys, keys, 0)  # layer 1 never runs: the pass stopped half way
    with pytest.raises(CacheStateError, match="forward pass stopped half way"):
        cache.update(keys, keys, 0)


def test_steps_longer_than_the_window_are_refused():
    player = Player(sinks=4, window=10, dtype=torch.float32)
    player.feed(4)
    with pytest.raises(CacheConfigError, match="feed at most 10 at a time"):
        player.feed(11)
