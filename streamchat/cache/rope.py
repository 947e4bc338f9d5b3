"""Rotary geometry: rotate stored keys by a position delta, exactly and cheaply.

A key stored at position p becomes the key at position p + shift by one more rotation
by shift * inv_freq. The angles are computed in float64 from the model's own
frequencies (so they agree with the model's rotation), the product in float32, and
the caller rounds once to the storage dtype.

Every shift a cache can meet has a precomputed row, so a decode pass looks its cos and
sin up with a device tensor index: no host round trip, no table edge to fall off.
"""

from __future__ import annotations

import torch

from streamchat.cache.architectures import RotaryLayout
from streamchat.errors import CacheConfigError


class RotaryTable:
    """cos and sin of shift * frequency for shifts 0..max_shift, laid out along the rotary dims."""

    def __init__(self, inv_freq: torch.Tensor, layout: RotaryLayout, max_shift: int) -> None:
        if layout not in ("rotate_half", "interleaved"):
            raise CacheConfigError(f"unknown rotary layout {layout!r}; expected rotate_half or interleaved")
        self.layout: RotaryLayout = layout
        self.inv_freq = inv_freq.detach().to("cpu", torch.float64)
        self.rotary_dim = 2 * self.inv_freq.numel()
        self.max_shift = max_shift
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def same_geometry(self, inv_freq: torch.Tensor, layout: RotaryLayout) -> bool:
        return layout == self.layout and torch.equal(inv_freq.detach().to("cpu", torch.float64), self.inv_freq)

    def cos_sin(self, shift: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 cos and sin [rotary_dim] of a shift given as a one-element integer tensor on the table's device.

        Shifts run from -max_shift to max_shift; cos is even and sin odd in the shift.
        """
        cos_table, sin_table = self.table(shift.device)
        row = shift.abs().reshape(1)
        cos, sin = cos_table.index_select(0, row)[0], sin_table.index_select(0, row)[0]  # [rotary_dim / 2]
        return self._laid_out(cos), self._laid_out(sin * shift.sign().reshape(1).to(sin.dtype))

    def cos_sin_rows(self, shifts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos_sin for each of `shifts` [n] at once: float32 cos and sin [n, rotary_dim] (a batch's sink shifts)."""
        cos_table, sin_table = self.table(shifts.device)
        rows = shifts.abs()
        cos, sin = cos_table.index_select(0, rows), sin_table.index_select(0, rows)  # [n, rotary_dim / 2]
        return self._laid_out(cos), self._laid_out(sin * shifts.sign()[:, None].to(sin.dtype))

    def partner(self, x: torch.Tensor) -> torch.Tensor:
        """The vector that rotation mixes in: rotated = x * cos + partner(x) * sin."""
        if self.layout == "rotate_half":
            first, second = x.chunk(2, dim=-1)
            return torch.cat((-second, first), dim=-1)
        # [..., rotary_dim] -> pairs [..., rotary_dim / 2, 2] -> (-odd, even) -> [..., rotary_dim]
        return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)

    def rotate(self, x: torch.Tensor, shift: int) -> torch.Tensor:
        """x [..., rotary_dim] rotated by `shift` positions, in float32."""
        cos, sin = self.cos_sin(torch.tensor(shift, device=x.device))
        x = x.float()
        return torch.addcmul(x * cos, self.partner(x), sin)

    def table(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin rows [max_shift + 1, rotary_dim / 2] on `device`, made once per device."""
        table = self._tables.get(device)
        if table is None:
            angles = torch.arange(self.max_shift + 1, dtype=torch.float64)[:, None] * self.inv_freq[None, :]
            table = self._tables[device] = (angles.cos().float().to(device), angles.sin().float().to(device))
        return table

    def _laid_out(self, half: torch.Tensor) -> torch.Tensor:
        """Frequencies [rotary_dim / 2] spread over the rotary dims as the layout pairs them."""
        if self.layout == "rotate_half":
            return torch.cat((half, half), dim=-1)
        return half.repeat_interleave(2, dim=-1)
