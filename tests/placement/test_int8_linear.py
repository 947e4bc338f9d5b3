import pytest
import torch

from streamchat.placement.int8_linear import Int8Linear, fits_int8_kernel


def linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("seq", [1, 17], ids=["decode (int8 kernel)", "prompt chunk (widened weights)"])
def test_it_computes_with_the_rounded_weights(dtype: torch.dtype, bias: bool, seq: int):
    original = linear(64, 48, dtype, bias)
    layer = Int8Linear(original)
    hidden = torch.randn(2, seq, 64, dtype=dtype)  # [batch, seq, in]
    # What the layer stands for: the int8 rows times their scales, in float32.
    weight = layer.weight_int8.float() * layer.scales.float()[:, None]
    expected = hidden.float() @ weight.T + (original.bias.float() if bias else 0)
    got = layer(hidden)
    assert got.shape == (2, seq, 48) and got.dtype == dtype
    assert torch.allclose(got.float(), expected, atol=2e-2 * expected.abs().max().item())


def test_each_row_uses_the_int8_range_and_stays_close_to_the_float_weights():
    original = linear(32, 16, torch.float32)
    layer = Int8Linear(original)
    assert layer.weight_int8.dtype == torch.int8
    assert layer.weight_int8.abs().amax(dim=1).tolist() == [127] * 16
    rebuilt = layer.weight_int8.float() * layer.scales[:, None]
    assert ((rebuilt - original.weight).abs() <= layer.scales[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize(("width", "fits"), [(16, True), (576, True), (1536, True), (56, False), (30, False)])
def test_only_widths_the_kernel_computes_correctly_are_taken(width: int, fits: bool):
    assert fits_int8_kernel(torch.nn.Linear(width, 8)) is fits
