import ctypes
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch

from streamchat.cache.quantized_kv import QuantizedWindow, quantize
from streamchat.placement.attention import decode_attention, decode_attention_stored, decode_mask
from streamchat.placement.native import (
    KERNELS,
    NativeKernels,
    kernel_signatures,
    load_native_kernels,
    use_native_kernels,
)

HIDDEN = torch.finfo(torch.float32).min


def fresh_load(
    directory: Path, monkeypatch: pytest.MonkeyPatch, asked: str | None = None, **environment: str
) -> NativeKernels | None:
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    load_native_kernels.cache_clear()
    try:
        return load_native_kernels(directory, asked)
    finally:
        load_native_kernels.cache_clear()


def test_they_are_built_once_and_reused(kernels, tmp_path, monkeypatch):
    shutil.copy(kernels.library, tmp_path / kernels.library.name)
    # A compiler that fails: nothing is compiled.
    reused = fresh_load(tmp_path, monkeypatch, asked=kernels.variant, CC="false")
    assert reused is not None and reused.library == tmp_path / kernels.library.name


def test_the_bindings_are_read_from_the_header():
    signatures = kernel_signatures((KERNELS / "kernels.h").read_text())
    kernels = {
        "int4_rows",
        "int8_rows",
        "int8_blocks",
        "decode_attention",
        "decode_attention_int8",
        "rms_norm",
        "decode_layers",
    }
    assert set(signatures) == kernels
    returned, arguments = signatures["rms_norm"]
    assert returned is None
    assert arguments == [ctypes.c_void_p] * 3 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    returned, arguments = signatures["int4_rows"]
    assert returned is ctypes.c_int and len(arguments) == 10 and arguments[-2:] == [ctypes.c_int, ctypes.c_int]
    assert len(signatures["decode_attention"][1]) == 19
    # table, layers; dims, slots, sinks, hidden, cos, sin, sink_cos, sink_sin, mask; eps, scale; threads
    returned, arguments = signatures["decode_layers"]
    pointers = [ctypes.c_void_p] * 9
    assert returned is ctypes.c_int
    assert arguments == [ctypes.c_void_p, ctypes.c_int64, *pointers, ctypes.c_float, ctypes.c_float, ctypes.c_int]
    assert len(signatures["decode_attention_int8"][1]) == 14
    with pytest.raises(ValueError, match="rows uses the type double, which has no binding"):
        kernel_signatures("int rows(const void *x, double scale);")


def reloaded(kernels, tmp_path, monkeypatch, decode_layers) -> NativeKernels | None:
    """The built library loaded afresh (no compiler: nothing rebuilt), its decode_layers replaced by one that
    calls `decode_layers(run, table, dims, slots, *rest)`, `run` the library's own."""
    shutil.copy(kernels.library, tmp_path / kernels.library.name)
    run = NativeKernels.decode_layers
    monkeypatch.setattr(NativeKernels, "decode_layers", lambda self, *args: decode_layers(partial(run, self), *args))
    return fresh_load(tmp_path, monkeypatch, asked=kernels.variant, CC="false")


def test_loading_runs_decode_layers_once_on_a_synthetic_layer_set(kernels, tmp_path, monkeypatch):
    tables = []

    def recorded(run, table, dims, *rest):
        tables.append((table.shape, len(dims)))
        return run(table, dims, *rest)

    assert reloaded(kernels, tmp_path, monkeypatch, recorded) is not None
    assert tables == [(torch.Size([2, 22]), 19)]  # two layers of decode_layers.c's 22 fields; its 19 dims


def wrong_slots(run, table, dims, slots, *rest):
    return run(table, dims, slots.flip(0), *rest)  # each row's token written into the other row's slot


def left_undone(run, *args):
    return None


def refusing(run, *args):
    raise ValueError("the decode layers kernel does not take these sizes")


@pytest.mark.parametrize("decode_layers", [wrong_slots, left_undone, refusing])
def test_a_decode_layers_that_disagrees_with_torch_leaves_no_native_kernels(
    kernels, tmp_path, monkeypatch, decode_layers
):
    assert reloaded(kernels, tmp_path, monkeypatch, decode_layers) is None


@pytest.mark.parametrize(
    "environment",
    [{"STREAMCHAT_NATIVE_KERNELS": "0"}, {"CC": "false"}, {"CC": "/nowhere/cc"}],
    ids=["turned off", "failing compiler", "no compiler"],
)
def test_where_they_cannot_be_built_there_are_none(tmp_path, monkeypatch, environment):
    assert fresh_load(tmp_path, monkeypatch, **environment) is None
    assert list(tmp_path.glob("*.so")) == []


def reference(query, keys, values, mask, scale):
    """float64 attention of query [B, KV, G, D]: softmax(q k^T * scale + mask) v."""
    scores = query.double() @ keys.double().transpose(-1, -2) * scale
    if mask is not None:
        scores = scores + mask.double()
    return torch.softmax(scores, dim=-1) @ values.double()


def cache(batch, kv_heads, slots, dim, dtype, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # A cache allocated wider than what is attended to: the kernel reads a view of it.
    keys, values = (torch.randn(batch, kv_heads, slots + 7, dim, generator=generator).to(dtype) for _ in "kv")
    return keys[:, :, :slots], values[:, :, :slots]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "kv_heads", "groups", "dim", "slots"),
    [
        (1, 3, 3, 64, 68),  # the default model's shape, a short cache
        (1, 3, 3, 64, 2005),  # ... a full one: eight chunks, the last partial
        (2, 1, 8, 128, 256),  # one chunk exactly; eight query heads a key head
        (3, 2, 1, 80, 257),  # no grouping; a head size without its own specialisation
        (1, 1, 2, 64, 1),
    ],
)
def test_attention_matches_the_softmax_of_the_scores(kernels, dtype, batch, kv_heads, groups, dim, slots):
    keys, values = cache(batch, kv_heads, slots, dim, dtype)
    query = torch.randn(batch, kv_heads, groups, dim).to(dtype)
    visible = torch.rand(batch, 1, 1, slots, generator=torch.Generator().manual_seed(1)) > 0.3
    visible[..., 0] = True
    mask = decode_mask(visible)
    got = kernels.decode_attention(query, keys, values, mask, 0.125)
    expected = reference(query, keys, values, mask, 0.125)
    assert got.dtype == dtype and got.shape == expected.shape
    # float32 throughout: only the output's rounding to the dtype is left.
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert (got.double() - expected).norm() / expected.norm() < tolerance


def test_a_mask_shared_by_the_rows_and_no_mask(kernels):
    keys, values = cache(2, 2, 300, 64, torch.float32)
    query = torch.randn(2, 2, 4, 64)
    shared = torch.zeros(1, 1, 1, 300)
    shared[..., 10:280] = HIDDEN  # whole chunks of slots hidden
    for mask in (shared, None):
        got = kernels.decode_attention(query, keys, values, mask, 0.3)
        torch.testing.assert_close(got.double(), reference(query, keys, values, mask, 0.3), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("groups", "dim"), [(17, 64), (2, 72), (2, 272)])
def test_shapes_it_does_not_take_are_left_to_torch(kernels, groups, dim):
    keys, values = cache(1, 1, 20, dim, torch.float32)
    assert kernels.decode_attention(torch.randn(1, 1, groups, dim), keys, values, None, 1.0) is None


def test_decode_attention_goes_through_the_kernel_once_in_use(kernels, monkeypatch):
    keys, values = cache(2, 3, 500, 64, torch.bfloat16)
    query = torch.randn(2, 9, 1, 64).to(torch.bfloat16)  # [B, H, 1, D] as a model's layer gives it
    visible = torch.ones(2, 1, 1, 500, dtype=torch.bool)
    visible[1, ..., 3:40] = False
    use_native_kernels(None)
    products = decode_attention(query, keys, values, visible, 0.125)
    use_native_kernels(kernels)
    try:
        native = decode_attention(query, keys, values, visible, 0.125)
    finally:
        use_native_kernels(None)
    assert native.shape == products.shape == (2, 1, 9, 64)
    assert not torch.equal(native, products)  # not the products' path: the scores are not rounded to bfloat16
    packed = query.reshape(2, 3, 3, 64)
    expected = reference(packed, keys, values, decode_mask(visible), 0.125).reshape(2, 1, 9, 64)
    assert (native.double() - expected).norm() < (products.double() - expected).norm()


def int8_window(keys: torch.Tensor, values: torch.Tensor, sinks: list[int]) -> QuantizedWindow:
    """keys and values [B, KV, S, D] as an int8 cache holds them: row b's first sinks[b] slots exact (in sink
    columns as wide as the widest row's), the rest levels and scales."""
    (key_levels, key_scales), (value_levels, value_scales) = quantize(keys), quantize(values)
    columns = max(sinks)
    exact_keys, exact_values = keys[:, :, :columns].contiguous(), values[:, :, :columns].contiguous()
    return QuantizedWindow(
        key_levels, value_levels, key_scales, value_scales, exact_keys, exact_values, torch.tensor(sinks)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("kv_heads", "groups", "dim", "slots", "sinks"),
    [
        (3, 3, 64, 2004, [4, 4]),  # the default model's full cache: sinks in the first chunk only
        (2, 8, 128, 300, [300, 2]),  # a row all sinks; a head size of its own specialisation
        (1, 2, 80, 257, [0, 9]),  # no sinks in one row (a sliding layer's window)
    ],
)
def test_int8_attention_reads_the_window_as_stored_as_torch_reads_it_widened(
    kernels, dtype, kv_heads, groups, dim, slots, sinks
):
    keys, values = cache(2, kv_heads, slots, dim, dtype)
    window = int8_window(keys, values, sinks)
    query = torch.randn(2, kv_heads, groups, dim).to(dtype)
    visible = torch.rand(2, 1, 1, slots, generator=torch.Generator().manual_seed(1)) > 0.3
    visible[..., 0] = True
    mask = decode_mask(visible)
    got = kernels.decode_attention_int8(query, window, mask, 0.125)
    assert got is not None and got.dtype == dtype and got.shape == (2, kv_heads, groups, dim)
    # Against the window widened in float64 (levels times scales, the sinks exact): the same numbers, summed in
    # another order (on AVX2, 64-dim heads' scores on int16 queries: about 16 bits, 3e-5), then the output's
    # rounding to the dtype.
    wide_keys = window.keys.double() * window.key_scales.double()
    wide_values = window.values.double() * window.value_scales.double()
    for row, count in enumerate(sinks):
        wide_keys[row, :, :count], wide_values[row, :, :count] = keys[row, :, :count], values[row, :, :count]
    tolerance = 1e-4 if dtype == torch.float32 else 1e-2
    expected = reference(query, wide_keys, wide_values, mask, 0.125)
    assert (got.double() - expected).norm() / expected.norm() < tolerance
    # Against the cache unquantized: within the int8 rounding of keys and values.
    exact = reference(query, keys, values, mask, 0.125)
    assert (got.double() - exact).norm() / exact.norm() < 2e-2


def test_int8_attention_leaves_to_torch_what_it_does_not_take(kernels):
    keys, values = cache(1, 1, 20, 64, torch.float32)
    window = int8_window(keys, values, [4])
    assert kernels.decode_attention_int8(torch.randn(1, 1, 17, 64), window, None, 1.0) is None  # 17 groups
    assert kernels.decode_attention_int8(torch.randn(1, 1, 2, 64).bfloat16(), window, None, 1.0) is None  # dtype


def test_decode_attention_stored_reads_an_int8_window_through_the_kernel_once_in_use(kernels, monkeypatch):
    keys, values = cache(2, 3, 500, 64, torch.bfloat16)
    window = int8_window(keys, values, [4, 2])
    query = torch.randn(2, 9, 1, 64).to(torch.bfloat16)  # [B, H, 1, D] as a model's layer gives it
    visible = torch.ones(2, 1, 1, 500, dtype=torch.bool)
    visible[1, ..., 3:40] = False
    use_native_kernels(None)
    widened = decode_attention_stored(query, window, visible, 0.125)  # torch's: the window widened
    calls = []
    monkeypatch.setattr(kernels, "_attention_int8", lambda *arguments: calls.append(1) or 0)
    use_native_kernels(kernels)
    try:
        decode_attention_stored(query, window, visible, 0.125)
        monkeypatch.undo()
        native = decode_attention_stored(query, window, visible, 0.125)
    finally:
        use_native_kernels(None)
    assert calls == [1] and native.shape == widened.shape == (2, 1, 9, 64)
    torch.testing.assert_close(native.float(), widened.float(), rtol=0, atol=2e-2)


def llama_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm, as written there."""
    wide = hidden.float()
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)
    return weight * wide.to(hidden.dtype)


@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (2, 16)])
def test_rms_norm_is_llamas(kernels, shape):
    generator = torch.Generator().manual_seed(len(shape))
    hidden = (torch.randn(shape, generator=generator) * 3).bfloat16()
    weight = torch.randn(shape[-1], generator=generator).bfloat16()
    got, expected = kernels.rms_norm(hidden, weight, 1e-5), llama_rms_norm(hidden, weight, 1e-5)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # The sum of squares is added in another order: at most a rounding apart, and rarely that.
    differ = got != expected
    assert differ.float().mean() < 0.01
    assert torch.allclose(got[differ].float(), expected[differ].float(), rtol=2**-7, atol=0)


def test_rms_norm_leaves_what_it_does_not_take_to_torch(kernels):
    assert kernels.rms_norm(torch.randn(2, 64), torch.randn(64), 1e-5) is None  # float32
    assert kernels.rms_norm(torch.randn(2, 72).bfloat16(), torch.randn(72).bfloat16(), 1e-5) is None
