import copy
import shutil
from pathlib import Path

import pytest
import torch

from streamchat.placement import native_int4
from streamchat.placement.device import Accelerators
from streamchat.placement.int4_linear import GROUP_SIZE, Int4Linear, quantize_groups
from streamchat.placement.int8_linear import Int8Head
from streamchat.placement.native_int4 import TiledInt4Linear, fits_native_int4, load_int4_kernel, pack_tiles
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.support.models import tiny_model

# Where the kernel must build: this CPU runs it and a C compiler is here (CI's machines).
BUILDS_HERE = native_int4._cpu_runs_it() and shutil.which("cc") is not None


def fresh_load(directory: Path, monkeypatch: pytest.MonkeyPatch, **environment: str):
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    load_int4_kernel.cache_clear()
    try:
        return load_int4_kernel(directory)
    finally:
        load_int4_kernel.cache_clear()


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> native_int4.Int4Kernel:
    built = load_int4_kernel(tmp_path_factory.mktemp("kernels"))
    if built is None:
        assert not BUILDS_HERE, "the int4 kernel did not build on a CPU that runs it, with a C compiler here"
        pytest.skip("this machine cannot build or run the int4 kernel (AVX-512 VNNI on Linux x86-64, a C compiler)")
    return built


def linear(in_features: int, out_features: int, dtype: torch.dtype, bias: bool = True) -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(in_features, out_features, bias=bias).to(dtype)


def test_the_tiles_hold_the_levels_steps_and_minimums_int4_linear_quantizes_to():
    weight = linear(96, 48, torch.float32).weight.detach()
    nibbles, params = pack_tiles(weight)
    assert nibbles.shape == (3, 3, 256) and params.shape == (3, 3, 2, 16) and params.dtype == torch.float16
    levels, step, minimum = quantize_groups(weight)
    assert torch.equal(native_int4.tile_levels(nibbles).int(), levels)
    expected = levels * step.half().float().repeat_interleave(GROUP_SIZE, 1)
    expected += minimum.half().float().repeat_interleave(GROUP_SIZE, 1)
    assert torch.equal(native_int4.unpack_tiles(nibbles, params, torch.float32), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [True, False])
# One row, a row block and one, several blocks and a partial one, a long chunk.
@pytest.mark.parametrize("rows", [1, 9, 21, 300])
def test_it_computes_with_the_grouped_weights(kernel, dtype: torch.dtype, bias: bool, rows: int):
    original = linear(96, 64, dtype, bias)
    layer = TiledInt4Linear(original, kernel)
    hidden = torch.randn(1, rows, 96, generator=torch.Generator().manual_seed(rows)).to(dtype)
    expected = hidden.float() @ layer.widened(torch.float32).T + (original.bias.float() if bias else 0)
    got = layer(hidden)
    assert got.shape == (1, rows, 64) and got.dtype == dtype
    # Activations are quantized to int8 per group of 32: about 1 % of the product's size.
    error = (got.float() - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.03
    assert torch.equal(layer.levels().int(), quantize_groups(original.weight)[0])


def test_each_row_is_computed_on_its_own(kernel):
    layer = TiledInt4Linear(linear(64, 32, torch.bfloat16), kernel)
    rows = torch.randn(11, 64).to(torch.bfloat16)
    together = layer(rows)
    assert torch.equal(torch.cat([layer(row[None]) for row in rows]), together)


def test_a_compiled_step_calls_the_kernel_as_an_op(kernel):
    layer = TiledInt4Linear(linear(64, 32, torch.float32), kernel)
    rows = torch.randn(3, 64)
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    assert torch.equal(compiled(rows), layer(rows))


@pytest.mark.parametrize(
    ("shape", "fits"), [((32, 16), True), ((576, 1536), True), ((48, 64), False), ((64, 40), False)]
)
def test_only_whole_groups_and_tiles_are_taken(shape: tuple[int, int], fits: bool):
    assert fits_native_int4(torch.nn.Linear(*shape)) is fits


def test_a_model_quantized_to_int4_uses_the_kernel_where_it_builds(kernel):
    model = copy.deepcopy(tiny_model("llama"))  # quantized in place; tiny models are shared
    plan = plan_quantization("int4", "cpu", "float32", Accelerators())
    quantize_model(model, plan, kernel.library.parent)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, TiledInt4Linear) and isinstance(layer.mlp.down_proj, TiledInt4Linear)
    assert isinstance(model.lm_head, Int8Head)  # the head stays int8 (quantization.py says why)


def test_without_a_kernel_directory_int4_layers_are_atens():
    model = copy.deepcopy(tiny_model("llama"))  # quantized in place; tiny models are shared
    quantize_model(model, plan_quantization("int4", "cpu", "float32", Accelerators()))
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)


def test_it_is_built_once_and_reused(kernel, tmp_path, monkeypatch):
    shutil.copy(kernel.library, tmp_path / kernel.library.name)
    reused = fresh_load(tmp_path, monkeypatch, CC="false")  # a compiler that fails: nothing is compiled
    assert reused is not None and reused.library == tmp_path / kernel.library.name


@pytest.mark.parametrize(
    "environment",
    [{"STREAMCHAT_NATIVE_KERNELS": "0"}, {"CC": "false"}, {"CC": "/nowhere/cc"}],
    ids=["turned off", "failing compiler", "no compiler"],
)
def test_where_it_cannot_be_built_int4_layers_fall_back_to_atens(tmp_path, monkeypatch, environment):
    assert fresh_load(tmp_path, monkeypatch, **environment) is None
    assert list(tmp_path.glob("*.so")) == []
    model = copy.deepcopy(tiny_model("llama"))  # quantized in place; tiny models are shared
    quantize_model(model, plan_quantization("int4", "cpu", "float32", Accelerators()), tmp_path)
    assert isinstance(model.model.layers[0].self_attn.q_proj, Int4Linear)
