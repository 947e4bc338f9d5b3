import copy

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.batch import CacheBatch
from streamchat.cache.quantized_kv import KV_FORMAT_ATTRIBUTE
from streamchat.placement.device import Accelerators
from streamchat.placement.fusion import fuse_projections
from streamchat.placement.lean_forward import LeanForward, lean_forward_for
from streamchat.placement.native import use_native_kernels
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.placement.conftest import BUILDS_HERE
from tests.support.models import VOCAB, tiny_model

STEPS = 40


def native_int4(
    kernels, model_type: str = "llama", dtype: torch.dtype = torch.bfloat16, kv_format: str = "full", **tiny
) -> torch.nn.Module:
    """A tiny model fused and quantized to int4 through the native kernels, which are in use; its caches store
    keys and values in `kv_format`."""
    model = copy.deepcopy(tiny_model(model_type, dtype=dtype, **tiny))  # quantized in place; tiny models are shared
    setattr(model, KV_FORMAT_ATTRIBUTE, kv_format)
    fuse_projections(model)
    quantize_model(model, plan_quantization("int4", "cpu", str(dtype).removeprefix("torch."), Accelerators()), kernels)
    use_native_kernels(kernels)
    return model


def counting(monkeypatch, kernels) -> list[int]:
    """How many rows each call of the fused kernel ran, as it runs (the kernel itself runs)."""
    calls: list[int] = []
    run = kernels.decode_layers

    def counted(table, dims, slots, *rest):
        calls.append(slots.numel())
        return run(table, dims, slots, *rest)

    monkeypatch.setattr(kernels, "decode_layers", counted)
    return calls


def unfused(model: torch.nn.Module) -> LeanForward:
    """The lean forward through torch's operators, layer by layer: what the fused decode must equal."""
    lean = lean_forward_for(model)
    lean.fused = None
    return lean


def caches_for(model: torch.nn.Module, shapes: list[tuple[int, int]], seed: int):
    """Caches of (sinks, window) each, fed prompts of different lengths; the logits of their last tokens [n, vocab]."""
    generator = torch.Generator().manual_seed(seed)
    caches, logits = [], []
    for index, (sinks, window) in enumerate(shapes):
        cache = SinkCache.for_model(model, sinks, window)
        prompt = torch.randint(3, VOCAB, (1, 9 + 5 * index), generator=generator)
        logits.append(forward(model, cache, prompt).logits[0, -1])
        caches.append(cache)
    return caches, torch.stack(logits)


def decode_alone(model: torch.nn.Module, lean: LeanForward, sinks: int, window: int) -> tuple[torch.Tensor, SinkCache]:
    """STEPS greedy tokens through one cache (evicting on the way): every pass's logits [STEPS, vocab], the cache."""
    (cache,), logits = caches_for(model, [(sinks, window)], seed=1)
    seen = []
    with torch.inference_mode():
        for _ in range(STEPS):
            token = logits.argmax(-1).reshape(1, 1)
            with cache.decode_pass():
                inputs = cache.decode_inputs(token)
                logits = lean(token, inputs.position_ids, inputs.attention_mask, cache)[:, -1]
            seen.append(logits)
    assert cache.stats().evicted > 0
    return torch.cat(seen), cache


def same_storage(ours: SinkCache, theirs: SinkCache) -> bool:
    """Every tensor the caches store into equal: keys, values, an int8 cache's scales and exact sinks."""
    layers = zip(ours.layers, theirs.layers, strict=True)
    return all(
        torch.equal(mine, other)
        for layer, their_layer in layers
        for mine, other in zip(layer.stored_tensors(), their_layer.stored_tensors(), strict=True)
    )


# llama; qwen2 adds a bias to q, k and v; llama3 scales its rotary angles. An int8 cache: quantized as it is written.
@pytest.mark.parametrize(
    ("model_type", "tiny", "kv_format"),
    [
        ("llama", {}, "full"),
        ("qwen2", {}, "full"),
        ("llama", {"rope_scaling": "llama3"}, "full"),
        ("llama", {}, "int8"),
    ],
)
def test_one_row_through_the_fused_decode_equals_the_lean_forward_bit_for_bit(
    kernels, monkeypatch, model_type, tiny, kv_format
):
    model = native_int4(kernels, model_type, kv_format=kv_format, **tiny)
    calls = counting(monkeypatch, kernels)
    fused_logits, fused_cache = decode_alone(model, lean_forward_for(model), sinks=4, window=20)
    assert calls == [1] * STEPS
    expected_logits, expected_cache = decode_alone(model, unfused(model), sinks=4, window=20)
    assert torch.equal(fused_logits, expected_logits)
    assert same_storage(fused_cache, expected_cache)  # the slots written and the sinks turned, as the cache does


def decode_pooled(model: torch.nn.Module, lean: LeanForward, shapes: list[tuple[int, int]]):
    """STEPS greedy tokens for each of several caches of (sinks, window) in one pool: every pass's logits
    [STEPS, rows, vocab], the caches."""
    caches, logits = caches_for(model, shapes, seed=2)
    pool, seen = CacheBatch(), []
    pool.join(*caches)
    with torch.inference_mode():
        for _ in range(STEPS):
            tokens = logits.argmax(-1)
            with pool.decode_pass(list(tokens[:, None])) as opened:
                inputs = opened.inputs
                logits = lean(opened.input_ids, inputs.position_ids, inputs.attention_mask, pool)[:, -1]
            seen.append(logits)
    assert all(cache.stats().evicted > 0 for cache in caches)
    return torch.stack(seen), caches


POOLED = [(4, 20), (5, 23), (6, 26)]  # each conversation its own sinks and window


@pytest.mark.parametrize("kv_format", ["full", "int8"])
def test_rows_of_a_pool_with_their_own_sinks_and_windows_equal_the_lean_forward_bit_for_bit(
    kernels, monkeypatch, kv_format
):
    model = native_int4(kernels, kv_format=kv_format)
    calls = counting(monkeypatch, kernels)
    fused_logits, fused_caches = decode_pooled(model, lean_forward_for(model), POOLED)
    assert calls == [len(POOLED)] * STEPS
    expected_logits, expected_caches = decode_pooled(model, unfused(model), POOLED)
    assert torch.equal(fused_logits, expected_logits)
    assert all(same_storage(ours, theirs) for ours, theirs in zip(fused_caches, expected_caches, strict=True))


def test_one_fused_decode_reads_each_pass_from_the_storage_it_is_given_as_caches_come_and_go(kernels):
    """The table of addresses is laid out again where the storage moved (a pool after a cache alone, a new cache
    after the pool), reused where it did not: each pass as the unfused one, bit for bit."""
    model = native_int4(kernels, kv_format="int8")
    fused, reference = lean_forward_for(model), unfused(model)
    for _ in range(2):
        assert torch.equal(decode_alone(model, fused, 4, 20)[0], decode_alone(model, reference, 4, 20)[0])
        assert torch.equal(decode_pooled(model, fused, POOLED)[0], decode_pooled(model, reference, POOLED)[0])


def test_a_float32_model_or_torchs_int4_layers_have_no_fused_decode(kernels):
    assert lean_forward_for(native_int4(kernels, dtype=torch.float32)).fused is None
    model = copy.deepcopy(tiny_model("llama", dtype=torch.bfloat16))
    fuse_projections(model)
    quantize_model(model, plan_quantization("int4", "cpu", "bfloat16", Accelerators()))  # no native kernels
    assert lean_forward_for(model).fused is None


def test_with_the_native_kernels_turned_off_the_pass_runs_through_torch(kernels, monkeypatch):
    model = native_int4(kernels)
    lean = lean_forward_for(model)
    use_native_kernels(None)
    calls = counting(monkeypatch, kernels)
    logits, _ = decode_alone(model, lean, sinks=4, window=20)
    assert calls == [] and torch.isfinite(logits).all()


def test_the_default_model_decodes_through_the_fused_kernel_exactly_as_through_lean_forward(default_model, monkeypatch):
    model = default_model.model
    lean = lean_forward_for(model)
    if lean.fused is None:
        assert not BUILDS_HERE, "the default model loaded on a CPU that runs the native kernels has no fused decode"
        pytest.skip("no native kernels here: the default model's layers are torch's")
    calls = counting(monkeypatch, lean.fused.kernels)
    # Real weights: products and sums far from zero and near it, a rounding of every kind (a float32
    # ulp in a turned sink flips a bfloat16 and the logits drift apart within a few dozen steps).
    fused_logits, fused_caches = decode_pooled(model, lean, POOLED)
    assert calls == [len(POOLED)] * STEPS
    expected_logits, expected_caches = decode_pooled(model, unfused(model), POOLED)
    assert torch.equal(fused_logits, expected_logits)
    assert all(same_storage(ours, theirs) for ours, theirs in zip(fused_caches, expected_caches, strict=True))
