"""A player of the model for the sink cache's tests: synthetic keys with a known geometry.

Token t has a known key before RoPE (`raw_key(t)`, float64). The player takes each pass
through the cache (`with cache.forward_pass(ids)`, or `with cache.decode_pass()` and
decode_inputs), rotates the key once at the position the cache hands out, rounds it to the
storage dtype, and feeds it. Token identities ride in the values (base-16 digits: exact in
any dtype), so a test reads which token each slot the last query may see holds, without
asking the cache.
"""

import torch

from streamchat.cache import LayerSpec, SinkCache

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
        self.eviction = None  # what the last pass evicted

    def feed(self, count: int):
        """Feed the next `count` tokens in one eager pass; return what the last query sees, and its position."""
        with self.cache.forward_pass(torch.arange(self.seen, self.seen + count)[None]) as opened:
            self.eviction = opened.eviction
            return self._write(count, opened.inputs)

    def decode(self):
        """Feed the next token through the device-only decode pass."""
        with self.cache.decode_pass() as eviction:
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


def play(player: Player, counts: list[int]) -> list:
    """Feed `counts` tokens pass by pass (1: a decode pass); what each pass's last query saw, and its position."""
    return [player.feed(count) if count > 1 else player.decode() for count in counts]
