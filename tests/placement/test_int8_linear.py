import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from streamchat.placement.int8_linear import (
    REFINED_CANDIDATES,
    BlockInt8Embedding,
    Int8Head,
    Int8Linear,
    fits_int8_kernel,
    quantize_blocks,
)


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


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("seq", [1, 17], ids=["decode (int8 kernel)", "prompt chunk (widened weights)"])
def test_the_head_gives_float32_logits_with_each_rows_best_computed_in_float32(bias: bool, seq: int):
    original = linear(64, 256, torch.bfloat16, bias)
    head = Int8Head(original)
    hidden = torch.randn(2, seq, 64, dtype=torch.bfloat16)  # [batch, seq, in]
    rounded = Int8Linear.forward(head, hidden)  # what the kernel gives: bfloat16
    got = head(hidden)
    assert got.shape == (2, seq, 256) and got.dtype == torch.float32
    weight = head.weight_int8.float() * head.scales.float()[:, None]
    exact = hidden.float() @ weight.T + (original.bias.float() if bias else 0)
    best = rounded.float().topk(REFINED_CANDIDATES, dim=-1).indices
    assert torch.allclose(got.gather(-1, best), exact.gather(-1, best), rtol=1e-5, atol=1e-5)
    others = torch.ones_like(got, dtype=torch.bool).scatter_(-1, best, False)
    assert torch.equal(got[others], rounded.float()[others])
    # The rounding the head undoes: in bfloat16 some of those logits were off by more than float32's error.
    assert (rounded.float().gather(-1, best) - exact.gather(-1, best)).abs().max() > 1e-3


def test_a_float32_head_is_the_kernels_own_product():
    head = Int8Head(linear(64, 256, torch.float32))
    hidden = torch.randn(1, 1, 64)
    assert torch.equal(head(hidden), Int8Linear.forward(head, hidden))


def test_an_embedding_in_int8_blocks_holds_a_q8_0_table_exactly():
    # Quantizing the values GGUF's Q8_0 dequantizes to gives back its own bytes, and a looked-up row is their
    # dequantization (float32 products of the float16 scale and the level), value for value.
    rng = np.random.default_rng(0)
    values = rng.standard_normal((64, 256)).astype(np.float32)
    values[3, :32] = 0  # a block of zeros: scale 0
    blocks = quantize(values, GGMLQuantizationType.Q8_0)
    table = dequantize(blocks, GGMLQuantizationType.Q8_0)
    embedding = torch.nn.Embedding(64, 256)
    embedding.weight.data = torch.from_numpy(table.copy())
    packed = BlockInt8Embedding(embedding)
    raw = blocks.reshape(64, 8, 34)  # [rows, blocks, a float16 scale and 32 levels]
    assert np.array_equal(packed.scales.numpy(), raw[..., :2].copy().view(np.float16)[..., 0])
    assert np.array_equal(packed.weight.numpy(), raw[..., 2:].copy().view(np.int8).reshape(64, 256))
    ids = torch.tensor([[0, 3, 63], [5, 5, 1]])
    assert torch.equal(packed(ids), torch.from_numpy(table)[ids])
    assert quantize_blocks(torch.from_numpy(values))[0].equal(packed.weight)  # from floats, as gguf-py quantizes
