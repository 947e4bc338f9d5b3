"""Rotary geometry: rotate stored keys by a position delta, exactly and cheaply.

A key stored at position p becomes the key at position p + shift by one more rotation
by shift * inv_freq. The angles are computed in float64 from the model's own
frequencies (so they agree with the model's rotation), the product in float32, and
the caller rounds once to the storage dtype.
"""

from __future__ import annotations

import torch

from streamchat.cache.architectures import RotaryLayout
from streamchat.errors import CacheConfigError

# Shifts up to this many get a precomputed cos/sin row; rarer, larger ones are computed on demand.
MAX_TABLE_ROWS = 1 << 16


class RotaryTable:
    """cos and sin of shift * frequency for the shifts a cache meets, laid out along the rotary dims."""

    def __init__(self, inv_freq: torch.Tensor, layout: RotaryLayout, max_shift: int) -> None:
        if layout not in ("rotate_half", "interleaved"):
            raise CacheConfigError(f"unknown rotary layout {layout!r}; expected rotate_half or interleaved")
        self.layout: RotaryLayout = layout
        self.inv_freq = inv_freq.detach().to("cpu", torch.float64)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.rows = min(max_shift, MAX_TABLE_ROWS) + 1
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def same_geometry(self, inv_freq: torch.Tensor, layout: RotaryLayout) -> bool:
        return layout == self.layout and torch.equal(inv_freq.detach().to("cpu", torch.float64), self.inv_freq)

    def cos_sin(self, shift: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin of shift * inv_freq, each [rotary_dim], on `device`."""
        if abs(shift) >= self.rows:
            cos, sin = self._angles(torch.tensor([float(shift)], dtype=torch.float64))
            return cos[0].to(device), sin[0].to(device)
        cos_table, sin_table = self._table(device)
        cos, sin = cos_table[abs(shift)], sin_table[abs(shift)]
        # cos is even and sin odd in the shift.
        return (cos, sin) if shift >= 0 else (cos, -sin)

    def partner(self, x: torch.Tensor) -> torch.Tensor:
        """The vector that rotation mixes in: rotated = x * cos + partner(x) * sin."""
        if self.layout == "rotate_half":
            first, second = x.chunk(2, dim=-1)
            return torch.cat((-second, first), dim=-1)
        # [..., rotary_dim] -> pairs [..., rotary_dim / 2, 2] -> (-odd, even) -> [..., rotary_dim]
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def rotate(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        """x [..., rotary_dim] rotated by `shift` positions, in float32."""
        cos, sin = self.cos_sin(shift, x.device)
        x = x.float()
        return torch.addcmul(x * cos, self.partner(x), sin)

    def _table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        table = self._tables.get(device)
        if table is None:
            cos, sin = self._angles(torch.arange(self.rows, dtype=torch.float64))
            table = self._tables[device] = (cos.to(device), sin.to(device))
        return table

    def _angles(self, shifts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        angles = shifts[:, None] * self.inv_freq[None, :]  # [shifts, rotary_dim / 2]
        if self.layout == "rotate_half":
            angles = torch.cat((angles, angles), dim=-1)
        else:
            angles = angles.repeat_interleave(2, dim=-1)
        return angles.cos().float(), angles.sin().float()
