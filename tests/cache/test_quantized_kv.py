"""An int8 KV window: quantized as each token is written, read widened or as stored, the sinks exact throughout."""

import pytest
import torch

from streamchat.cache import LayerSpec, SinkCache, forward, layer_specs
from streamchat.cache.batch import CacheBatch
from streamchat.cache.feeding import model_logits
from streamchat.cache.quantized_kv import QuantizedWindow, dequantize, quantize, token_bytes, widened
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.errors import CacheConfigError, CacheStateError
from tests.cache.players import INV_FREQ
from tests.support.models import VOCAB, tiny_model

HEADS, DIM = 2, 64
# One rounding to int8 of a vector at its own scale: at most half a level, 0.5 / 127 of its largest value; as a
# norm over a 64-vector of random values, far less (measured 0.4-0.5 %).
WIDENED_TOLERANCE = 0.01


def synthetic_cache(kv_format: str, sinks: int = 4, window: int = 30) -> SinkCache:
    """A one-layer cache that tests feed keys and values of their own."""
    spec = LayerSpec(INV_FREQ.float())
    return SinkCache([spec], sinks=sinks, window=window, dtype=torch.bfloat16, kv_format=kv_format)


def model_cache(model, sinks: int, window: int, kv_format: str) -> SinkCache:
    """A cache for a tiny model in `kv_format` (the shared tiny models are left as they are)."""
    attention = model.config._attn_implementation
    return SinkCache(layer_specs(model), sinks, window, attention=attention, dtype=model.dtype, kv_format=kv_format)


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((ours.double() - theirs.double()).norm() / theirs.double().norm()).item()


def test_quantize_keeps_each_vector_within_half_a_level_and_a_zero_vector_zero():
    x = torch.randn(3, 5, 64) * torch.logspace(-3, 2, 5)[None, :, None]  # every scale of vector
    x[1, 2] = 0
    levels, scales = quantize(x)
    assert levels.dtype == torch.int8 and scales.shape == (3, 5, 1) and scales.dtype == torch.float32
    assert levels.abs().max() == 127 and levels.min() >= -127
    assert torch.equal(levels[1, 2], torch.zeros(64, dtype=torch.int8)) and scales[1, 2].item() == 0
    error = (dequantize(levels, scales, torch.float32) - x).abs()
    assert (error <= scales / 2 * (1 + 1e-6)).all()


def test_a_window_widened_reads_each_rows_sinks_exact_and_the_rest_from_its_levels():
    keys, values = torch.randn(2, HEADS, 9, DIM).bfloat16(), torch.randn(2, HEADS, 9, DIM).bfloat16()
    (key_levels, key_scales), (value_levels, value_scales) = quantize(keys), quantize(values)
    sinks = torch.tensor([3, 1])  # rows of a pool differ in sinks; sink columns as wide as the widest
    window = QuantizedWindow(
        key_levels, value_levels, key_scales, value_scales, keys[:, :, :3], values[:, :, :3], sinks
    )
    wide_keys, wide_values = widened(window)
    assert wide_keys.dtype == torch.bfloat16
    for row, count in enumerate(sinks.tolist()):
        assert torch.equal(wide_keys[row, :, :count], keys[row, :, :count])
        assert torch.equal(wide_values[row, :, :count], values[row, :, :count])
        expected = dequantize(key_levels[row, :, count:], key_scales[row, :, count:], torch.bfloat16)
        assert torch.equal(wide_keys[row, :, count:], expected)
    assert relative(wide_keys, keys) < WIDENED_TOLERANCE and relative(wide_values, values) < WIDENED_TOLERANCE


def test_a_token_takes_its_levels_and_a_scale_a_head_in_int8_and_its_dtype_in_full():
    config = tiny_model("llama").config  # 2 layers, 2 KV heads of 16 dims
    assert token_bytes(config, "int8", element_bytes=2) == 2 * 2 * 2 * (16 + 4)
    assert token_bytes(config, "full", element_bytes=2) == 2 * 2 * 2 * 16 * 2


def test_an_unknown_format_is_refused():
    with pytest.raises(CacheConfigError, match="int4"):
        synthetic_cache("int4")


def play(cache: SinkCache, keys: torch.Tensor, values: torch.Tensor, counts: list[int], decodes: int) -> list:
    """Feed keys/values [1, heads, n, dim] in eager passes of `counts`, then `decodes` decode passes; what each pass
    returned (copied, with its last query's mask)."""
    seen, returned = 0, []
    for count in [*counts, *[None] * decodes]:
        span = slice(seen, seen + (count or 1))
        if count is None:
            with cache.decode_pass():
                mask = cache.decode_inputs(torch.tensor([[seen]])).attention_mask
                stored = cache.update(keys[:, :, span], values[:, :, span], 0)
        else:
            with cache.forward_pass(torch.arange(seen, seen + count)[None]) as opened:
                mask = opened.inputs.attention_mask
                stored = cache.update(keys[:, :, span], values[:, :, span], 0)
        returned.append((stored[0].clone(), stored[1].clone(), mask[0, 0, -1]))
        seen += count or 1
    return returned


def test_an_int8_window_reads_as_the_full_one_within_a_rounding_and_its_sinks_exactly_through_a_rebase():
    keys, values = torch.randn(1, HEADS, 200, DIM).bfloat16(), torch.randn(1, HEADS, 200, DIM).bfloat16()
    full, int8 = synthetic_cache("full"), synthetic_cache("int8")
    counts, decodes = [10, 3, 1, 25, 1], 150  # past the window (evictions, sink shifts) and a rebase at 64
    passes = zip(play(full, keys, values, counts, decodes), play(int8, keys, values, counts, decodes), strict=True)
    for (full_keys, full_values, held), (int8_keys, int8_values, int8_held) in passes:
        assert torch.equal(held, int8_held)
        # The sinks (first 4 slots) as the full cache holds them, bit for bit: rotated from the same pristine copy.
        assert torch.equal(full_keys[:, :, :4], int8_keys[:, :, :4])
        assert torch.equal(full_values[:, :, :4], int8_values[:, :, :4])
        assert relative(int8_keys[:, :, held], full_keys[:, :, held]) < WIDENED_TOLERANCE
        assert relative(int8_values[:, :, held], full_values[:, :, held]) < WIDENED_TOLERANCE
    assert full.stats().evicted > 0 and full.ledger.position_offset > 0  # a rebase ran
    layer = int8.layers[0]
    assert layer.keys.dtype == layer.values.dtype == torch.int8 and layer.sink_keys.dtype == torch.bfloat16


def test_a_whole_snapshot_saved_and_loaded_continues_bit_for_bit():
    keys, values = torch.randn(1, HEADS, 120, DIM).bfloat16(), torch.randn(1, HEADS, 120, DIM).bfloat16()
    cache = synthetic_cache("int8")
    play(cache, keys, values, [10, 20], decodes=20)
    state = CacheSnapshot.whole(cache).tensors()
    assert state["layers.0.keys"].dtype == torch.int8 and "layers.0.sink_values" in state
    loaded = synthetic_cache("int8")
    CacheSnapshot.from_tensors(state, loaded).restore(loaded)
    for mine, theirs in zip(cache.layers[0].stored_tensors(), loaded.layers[0].stored_tensors(), strict=True):
        assert torch.equal(mine, theirs)
    rest = (keys[:, :, 50:], values[:, :, 50:])
    for ours, theirs in zip(play(cache, *rest, [], 30), play(loaded, *rest, [], 30), strict=True):
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


@pytest.mark.parametrize(("saved", "loading"), [("int8", "full"), ("full", "int8")])
def test_a_state_saved_in_another_format_is_refused_before_anything_is_written(saved, loading):
    keys, values = torch.randn(1, HEADS, 40, DIM).bfloat16(), torch.randn(1, HEADS, 40, DIM).bfloat16()
    cache = synthetic_cache(saved)
    play(cache, keys, values, [10], decodes=5)
    state = CacheSnapshot.whole(cache).tensors()
    with pytest.raises(CacheStateError, match=f"KV window is {saved}; this one's is {loading}"):
        CacheSnapshot.from_tensors(state, synthetic_cache(loading))


def test_taking_back_a_reply_restores_the_levels_scales_and_sinks_it_overwrote():
    keys, values = torch.randn(1, HEADS, 200, DIM).bfloat16(), torch.randn(1, HEADS, 200, DIM).bfloat16()
    cache = synthetic_cache("int8")
    play(cache, keys, values, [20, 20], decodes=0)
    before = [tensor.clone() for tensor in cache.layers[0].stored_tensors()]
    snapshot = CacheSnapshot.take(cache, reach=40)
    play(cache, keys[:, :, 100:], values[:, :, 100:], [], decodes=40)  # a reply: sinks turned, slots overwritten
    snapshot.restore(cache)
    # Levels, scales, pristine sinks and their exact copies, as before the reply.
    after = cache.layers[0].stored_tensors()
    assert all(torch.equal(mine, kept) for mine, kept in zip(after, before, strict=True))


def test_a_pool_of_int8_caches_decodes_each_row_as_it_would_decode_alone():
    model = tiny_model("llama")
    shapes = [(4, 28), (3, 12)]

    def filled(sinks: int, tokens: int, seed: int) -> SinkCache:
        cache = model_cache(model, sinks, 24, "int8")
        forward(model, cache, torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed)))
        return cache

    alone = [filled(sinks, tokens, seed) for seed, (sinks, tokens) in enumerate(shapes)]
    together = [filled(sinks, tokens, seed) for seed, (sinks, tokens) in enumerate(shapes)]
    expected = []
    for cache, token in zip(alone, (17, 99), strict=True):
        with cache.decode_pass():
            inputs = cache.decode_inputs(torch.tensor([[token]]))
            expected.append(model_logits(model, cache, torch.tensor([[token]]), inputs))
    batch = CacheBatch()
    batch.join(*together)
    with batch.decode_pass([torch.tensor([17]), torch.tensor([99])]) as opened:
        logits = model_logits(model, batch, opened.input_ids, opened.inputs)
    for row, wanted in enumerate(expected):
        torch.testing.assert_close(logits[row : row + 1], wanted, rtol=0, atol=1e-5)
    for cache in together:
        batch.leave(cache)  # its own storage again, a copy of its row: the next pass reads the same
    for one, other in zip(alone, together, strict=True):
        assert one.stats() == other.stats()
        decoded = []
        for cache in (one, other):
            with cache.decode_pass():
                inputs = cache.decode_inputs(torch.tensor([[5]]))
                decoded.append(model_logits(model, cache, torch.tensor([[5]]), inputs))
        torch.testing.assert_close(*decoded, rtol=0, atol=1e-4)


def test_caches_of_different_formats_share_no_pool():
    model = tiny_model("llama")
    caches = [model_cache(model, 4, 24, kv_format) for kv_format in ("full", "int8")]
    for cache in caches:
        forward(model, cache, torch.randint(3, VOCAB, (1, 8), generator=torch.Generator().manual_seed(0)))
    batch = CacheBatch()
    batch.join(caches[0])
    with pytest.raises(CacheStateError, match="same model"):
        batch.join(caches[1])


# llama; gemma2's sliding layers keep an int8 ring of their own (no sinks); phi rotates part of each key; cohere
# rotates interleaved pairs.
@pytest.mark.parametrize("model_type", ["llama", "gemma2", "phi", "cohere"])
def test_a_models_int8_cache_stays_close_to_its_full_one_and_its_saved_state_goes_on_exactly(model_type):
    model = tiny_model(model_type)
    ids = torch.randint(3, VOCAB, (1, 72), generator=torch.Generator().manual_seed(3))
    logits, caches = {}, {}
    for kv_format in ("full", "int8"):
        cache = caches[kv_format] = model_cache(model, 4, 24, kv_format)
        chunks = [forward(model, cache, ids[:, start : start + 12]).logits for start in range(0, 60, 12)]
        logits[kv_format] = torch.cat(chunks)
    assert relative(logits["int8"], logits["full"]) < 0.02
    state = CacheSnapshot.whole(caches["int8"]).tensors()
    loaded = model_cache(model, 4, 24, "int8")
    CacheSnapshot.from_tensors(state, loaded).restore(loaded)
    rest = [forward(model, cache, ids[:, 60:]).logits for cache in (caches["int8"], loaded)]
    assert torch.equal(*rest)
