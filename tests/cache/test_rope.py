import math

import pytest
import torch

from streamchat.cache.rope import RotaryTable

INV_FREQ = 1.0 / (10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8))


def rotate_reference(x: torch.Tensor, shift: int, interleaved: bool) -> torch.Tensor:
    """Rotate each pair of dims by shift * frequency, written out pair by pair."""
    out = x.clone().double()
    half = INV_FREQ.numel()
    for i, frequency in enumerate(INV_FREQ.tolist()):
        first, second = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        angle = shift * frequency
        a, b = x[..., first].double(), x[..., second].double()
        out[..., first] = a * math.cos(angle) - b * math.sin(angle)
        out[..., second] = b * math.cos(angle) + a * math.sin(angle)
    return out


@pytest.mark.parametrize("layout", ["rotate_half", "interleaved"])
@pytest.mark.parametrize("shift", [0, 1, 7, -5, 300])
def test_rotation_matches_pairwise_formula(layout, shift):
    table = RotaryTable(INV_FREQ, layout, max_shift=300)
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(shift + 50))
    expected = rotate_reference(x, shift, interleaved=layout == "interleaved")
    assert torch.allclose(table.rotate(x, shift).double(), expected, atol=1e-6)


def test_rotations_compose_and_invert():
    table = RotaryTable(INV_FREQ, "rotate_half", max_shift=100)
    x = torch.randn(5, 8, dtype=torch.float64)
    composed = table.rotate(table.rotate(x, 40), 2)
    assert torch.allclose(composed.double(), table.rotate(x, 42).double(), atol=1e-5)
    assert torch.allclose(table.rotate(table.rotate(x, 40), -40).double(), x, atol=1e-5)


@pytest.mark.parametrize("shift", [65_535, 65_536, 65_537, 99_999, -99_999])
def test_every_shift_up_to_the_largest_comes_from_the_table_without_a_cliff(shift):
    table = RotaryTable(INV_FREQ, "rotate_half", max_shift=99_999)
    cos, sin = table.cos_sin(torch.tensor(shift))
    expected = shift * INV_FREQ
    assert torch.equal(cos[:4], expected.cos().float()) and torch.equal(cos[4:], expected.cos().float())
    assert torch.equal(sin[:4], expected.sin().float()) and torch.equal(sin[4:], expected.sin().float())


def test_partial_rotary_is_read_from_the_frequencies():
    table = RotaryTable(INV_FREQ[:2], "rotate_half", max_shift=4)
    assert table.rotary_dim == 4


def test_same_geometry_compares_layout_and_frequencies():
    table = RotaryTable(INV_FREQ, "rotate_half", max_shift=4)
    assert table.same_geometry(INV_FREQ.float(), "rotate_half") is False  # float32 rounding differs
    assert table.same_geometry(INV_FREQ, "rotate_half")
    assert not table.same_geometry(INV_FREQ, "interleaved")
