"""The naive StreamingLLM reference, for tests only: what the paper's code does.

Keys are kept before RoPE, in float64, recovered by undoing the rotation the model
applied at the in-cache positions this cache handed out. Every step re-rotates the
whole cache at positions 0..len-1. Exact, and slow on purpose; it shares no code
with streamchat.cache.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

LAYOUTS = {"cohere": "interleaved"}  # every other supported model type rotates halves


def _rotate(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool):
    """x [..., seq, head_dim] in float64, rotated at positions [seq] over its first 2*len(inv_freq) dims."""
    rotary_dim = 2 * inv_freq.numel()
    angles = positions.double()[:, None] * inv_freq.to(positions.device).double()[None, :]
    cos, sin = angles.cos(), angles.sin()
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    if interleaved:
        even, odd = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    else:
        first, second = rot.chunk(2, dim=-1)
        out = torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    return torch.cat((out, rest), dim=-1)


class _Layer(CacheLayerMixin):
    is_compileable = False

    def __init__(self, inv_freq, interleaved, sliding_window):
        super().__init__()
        self.inv_freq, self.interleaved, self.sliding_window = inv_freq, interleaved, sliding_window
        self.is_sliding = sliding_window is not None
        self.raw_keys = None  # [batch, heads, len, dim] float64, before RoPE
        self.tokens: list[int] = []  # stream index of each cached token

    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, *args, **kwargs):
        raise NotImplementedError

    def get_mask_sizes(self, query_length):
        raise NotImplementedError

    def get_seq_length(self):
        return len(self.tokens)

    def get_max_length(self):
        return -1


class NaiveSinkCache(Cache):
    def __init__(self, model, sinks: int, window: int):
        config = model.config.get_text_config(decoder=True)
        rotary = next(module for name, module in model.named_modules() if name.endswith("rotary_emb"))
        interleaved = LAYOUTS.get(config.model_type) == "interleaved"
        layer_types, layer_kwargs = get_layer_types_and_kwargs(config)
        layers = []
        for layer_type, kwargs in zip(layer_types, layer_kwargs, strict=True):
            inv_freq = getattr(rotary, f"{layer_type}_inv_freq", None)
            inv_freq = rotary.inv_freq if inv_freq is None else inv_freq
            own = kwargs.get("sliding_window")
            layers.append(_Layer(inv_freq, interleaved, own if own is not None and own <= window else None))
        super().__init__(layers=layers)
        self.sinks, self.window = sinks, window
        self.kept: list[int] = []  # stream indices in the sink + window cache, in order
        self.seen = 0
        # Attention sees only distances, so in-cache positions may all be moved by one constant:
        # following another cache's query position keeps the model's own rounding of RoPE identical.
        self.frame = 0

    def follow(self, query_position: int) -> None:
        """Place the next token at `query_position`, keeping every in-cache distance."""
        self.frame = query_position - len(self.kept)

    def evict_for_space(self, incoming: int) -> None:
        excess = len(self.kept) + incoming - (self.sinks + self.window)
        if excess > 0:
            self.kept = self.kept[: self.sinks] + self.kept[self.sinks + excess :]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.frame + len(self.kept)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._visible_old(layer_idx)

    def get_mask_sizes(self, query_length, layer_idx):
        return self._visible_old(layer_idx) + query_length, 0

    def _visible_old(self, layer_idx):
        layer = self.layers[layer_idx]
        if layer.sliding_window is None:
            return len(self.kept)
        return min(self.seen, layer.sliding_window - 1)

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        layer = self.layers[layer_idx]
        incoming = key_states.shape[-2]
        base = self.frame + len(self.kept)  # the model rotated the new keys at base, base+1, ...
        device = key_states.device
        new_positions = torch.arange(base, base + incoming, device=device)
        raw_new = _rotate(key_states.double(), new_positions, -layer.inv_freq, layer.interleaved)
        new_tokens = list(range(self.seen, self.seen + incoming))
        if layer.raw_keys is None:
            layer.raw_keys, layer.values, layer.tokens = raw_new, value_states, new_tokens
        else:
            layer.raw_keys = torch.cat((layer.raw_keys, raw_new), dim=2)
            layer.values = torch.cat((layer.values, value_states), dim=2)
            layer.tokens = layer.tokens + new_tokens
        if layer.sliding_window is None:
            visible = self.kept + new_tokens
        else:
            old = [t for t in layer.tokens if t < self.seen][-(layer.sliding_window - 1) :]
            visible = old + new_tokens
        index = torch.tensor([layer.tokens.index(t) for t in visible], device=device)
        raw = layer.raw_keys.index_select(2, index)
        values = layer.values.index_select(2, index)
        if layer.sliding_window is None:
            positions = self.frame + torch.arange(len(visible), device=device)
        else:
            # As trained: distances in the stream, the first new query at `base`.
            positions = torch.tensor([base - (self.seen - t) for t in visible], device=device)
        keys = _rotate(raw, positions, layer.inv_freq, layer.interleaved).to(key_states.dtype)
        # Forget what no layer will need again.
        keep = set(visible) if layer.sliding_window is None else set(visible[-layer.sliding_window :])
        survivors = torch.tensor([i for i, t in enumerate(layer.tokens) if t in keep], device=device)
        layer.raw_keys = layer.raw_keys.index_select(2, survivors)
        layer.values = layer.values.index_select(2, survivors)
        layer.tokens = [t for t in layer.tokens if t in keep]
        if layer_idx == len(self.layers) - 1:
            self.kept = self.kept + new_tokens
            self.seen += incoming
        return keys, values
