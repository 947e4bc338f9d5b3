import copy

import pytest
import torch

from streamchat.placement import native_layers
from streamchat.placement.device import Accelerators
from streamchat.placement.int4_linear import GROUP_SIZE, GridLinear, Int4Linear, quantize_groups
from streamchat.placement.int8_linear import Int8Head, Int8Linear, quantize_blocks
from streamchat.placement.native_layers import (
    TiledInt4Linear,
    TiledInt8Head,
    TiledInt8Linear,
    fits_native_int4,
    fits_native_int8_blocks,
    pack_tiles,
)
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.support.models import tiny_model


def linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)


def test_the_tiles_hold_the_levels_steps_and_minimums_int4_linear_quantizes_to():
    weight = linear(96, 48, torch.float32).weight.detach()
    nibbles, params = pack_tiles(weight)
    assert nibbles.shape == (3, 3, 256) and params.shape == (3, 3, 2, 16) and params.dtype == torch.float16
    levels, step, minimum = quantize_groups(weight)
    assert torch.equal(native_layers.tile_levels(nibbles).int(), levels)
    expected = levels * step.half().float().repeat_interleave(GROUP_SIZE, 1)
    expected += minimum.half().float().repeat_interleave(GROUP_SIZE, 1)
    assert torch.equal(native_layers.unpack_tiles(nibbles, params, torch.float32), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
# One row, a row block and one, several blocks and a partial one, a long chunk.
@pytest.mark.parametrize("rows", [1, 9, 21, 300])
def test_it_computes_with_the_grouped_weights(kernels, dtype: torch.dtype, bias: bool, rows: int):
    original = linear(96, 64, dtype, bias)
    layer = TiledInt4Linear(original, kernels)
    hidden = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = hidden.float() @ layer.widened(torch.float32).T + (original.bias.float() if bias else 0)
    got = layer(hidden)
    assert got.shape == (1, rows, 64) and got.dtype == dtype
    # Activations are quantized to int8 per group of 32: about 1 % of the product's size.
    error = (got.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.03
    assert torch.equal(layer.levels().int(), quantize_groups(original.weight)[0])


def test_each_row_is_computed_on_its_own(kernels):
    layer = TiledInt4Linear(linear(64, 32, torch.bfloat16), kernels)
    rows = torch.randn(11, 64).to(torch.bfloat16)
    together = layer(rows)
    assert torch.equal(torch.cat([layer(row[None]) for row in rows]), together)


def test_a_compiled_step_calls_the_kernel_as_an_op(kernels):
    layer = TiledInt4Linear(linear(64, 32, torch.float32), kernels)
    rows = torch.randn(3, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(rows), layer(rows))


@pytest.mark.parametrize(
    ("shape", "fits"), [((32, 16), True), ((576, 1536), True), ((48, 64), False), ((64, 40), False)]
)
def test_only_whole_groups_and_tiles_are_taken(shape: tuple[int, int], fits: bool):
    assert fits_native_int4(torch.nn.Linear(*shape)) is fits


def test_a_model_quantized_to_int4_uses_the_kernel_where_there_is_one(kernels):
    model = copy.deepcopy(tiny_model("llama"))  # quantized in place; tiny models are shared
    plan = plan_quantization("int4", "cpu", "float32", Accelerators())
    quantize_model(model, plan, kernels)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, TiledInt4Linear) and isinstance(layer.mlp.down_proj, TiledInt4Linear)
    assert isinstance(model.lm_head, TiledInt8Head)  # the head stays int8 (quantization.py says why)


def test_without_native_kernels_int4_layers_are_atens():
    model = copy.deepcopy(tiny_model("llama"))  # quantized in place; tiny models are shared
    quantize_model(model, plan_quantization("int4", "cpu", "float32", Accelerators()))
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 9, 40])
def test_the_int8_head_gives_float32_logits_of_its_int8_rows(kernels, dtype: torch.dtype, rows: int):
    original = linear(96, 4 * 16 * 5, dtype)
    head = TiledInt8Head(original, kernels)
    reference = Int8Head(original)
    assert torch.equal(head.rows_int8(), reference.weight_int8)
    assert torch.equal(head.scales.to(dtype), reference.scales)
    hidden = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    exact = hidden.double() @ (head.rows_int8().double() * head.scales.double()[:, None]).T + original.bias.double()
    logits = head(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (1, rows, 320)
    # Two int8 parts of each activation keep about 16 bits: far closer than half precision's logits.
    assert (logits.double() - exact).norm() / exact.norm() < 1e-4


def test_the_int8_head_is_used_for_int4_and_int8_models_where_there_are_kernels(kernels):
    for method in ("int4", "int8"):
        model = copy.deepcopy(tiny_model("llama"))
        quantize_model(model, plan_quantization(method, "cpu", "bfloat16", Accelerators()), kernels)
        assert isinstance(model.lm_head, TiledInt8Head)
    model = copy.deepcopy(tiny_model("llama"))
    quantize_model(model, plan_quantization("int4", "cpu", "bfloat16", Accelerators()))
    assert isinstance(model.lm_head, Int8Head)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
# One row, a row block and one, a long chunk.
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_int8_blocks_compute_with_the_blocks_weights(kernels, dtype: torch.dtype, bias: bool, rows: int):
    original = linear(96, 64, dtype, bias)
    layer = TiledInt8Linear(original, kernels)
    blocks = quantize_blocks(original.weight)
    assert torch.equal(layer.blocks().levels, blocks.levels) and torch.equal(layer.blocks().scale, blocks.scale)
    hidden = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    exact = hidden.double() @ blocks.dense(torch.float64).T + (original.bias.double() if bias else 0)
    got = layer(hidden)
    assert got.shape == (1, rows, 64) and got.dtype == dtype
    # int16 activations keep about 16 bits: far closer than half precision's rounding of the outputs.
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    assert ((got.double() - exact).norm(dim=-1) / exact.norm(dim=-1)).max() < tolerance


def test_int8_blocks_read_as_such_are_taken_as_they_are(kernels):
    # A Q8_0 file's blocks (weights/gguf_source.py): the layer holds them, rounded no second time.
    blocks = quantize_blocks(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)))
    layer = TiledInt8Linear(GridLinear(blocks, None, torch.bfloat16), kernels)
    assert torch.equal(layer.blocks().levels, blocks.levels) and torch.equal(layer.blocks().scale, blocks.scale)
    assert torch.equal(layer.widened(torch.float32), blocks.dense(torch.float32))


def test_a_compiled_step_calls_the_int8_block_kernel_as_an_op(kernels):
    layer = TiledInt8Linear(linear(64, 32, torch.float32), kernels)
    rows = torch.randn(3, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(rows), layer(rows))


@pytest.mark.parametrize(("shape", "fits"), [((32, 16), True), ((96, 48), True), ((48, 64), False), ((64, 40), False)])
def test_int8_blocks_take_whole_blocks_and_tiles(shape: tuple[int, int], fits: bool):
    assert fits_native_int8_blocks(torch.nn.Linear(*shape)) is fits


def test_a_model_quantized_to_int8_holds_blocks_where_there_are_kernels(kernels):
    model = copy.deepcopy(tiny_model("llama"))
    quantize_model(model, plan_quantization("int8", "cpu", "bfloat16", Accelerators()), kernels)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, TiledInt8Linear) and isinstance(layer.mlp.down_proj, TiledInt8Linear)
    model = copy.deepcopy(tiny_model("llama"))
    quantize_model(model, plan_quantization("int8", "cpu", "bfloat16", Accelerators()))
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int8Linear)  # aten's, a scale per row


def test_no_rows_give_no_rows(kernels):
    original = linear(64, 32, torch.bfloat16)
    assert TiledInt4Linear(original, kernels)(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert TiledInt8Head(original, kernels)(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
    assert TiledInt8Linear(original, kernels)(torch.empty(0, 64, dtype=torch.bfloat16)).shape == (0, 32)
