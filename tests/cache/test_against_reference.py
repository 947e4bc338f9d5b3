"""The sink cache against the naive reference (tests/support/reference_cache.py) on real architectures.

Each tiny random model streams 20 prompt tokens and then 2000 decode steps, with a
few multi-token steps among them, through 4 sinks + a 60-token window: about 1960
evictions and dozens of position rebases. Both caches see the same tokens; the
logits after every step are compared. Single tokens take the engine's decode step
(device tensors only) once the sinks are full, the eager one before; longer steps
the eager one.

A kept prefix (--keep system) is sinks too, only more of them: the same streams run
with 40 kept tokens (they fill one by one after the prompt, through eager steps) on
a model of each kind the cache treats differently (KEPT_TYPES), within the same bounds.
"""

import copy

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.architectures import SUPPORTED_MODEL_TYPES
from streamchat.cache.layers import SinkLayer, SlidingLayer
from streamchat.engine.compiled_decode import decode_logits
from streamchat.placement.device import Accelerators
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.support.models import ROPE_SCALINGS, VOCAB, tiny_model
from tests.support.reference_cache import NaiveSinkCache

SINKS, WINDOW, PROMPT, DECODE_STEPS = 4, 60, 20, 2000
KEPT = 40  # a system turn's worth of kept tokens
# One model type per way the cache treats a layer: rotate-half (llama), interleaved pairs (cohere),
# partial rotary dims (gpt_neox), the model's own sliding-window layers beside sink layers (gemma2),
# two rotary geometries in one model (gemma3_text). The other types repeat one of these paths.
KEPT_TYPES = ["cohere", "gemma2", "gemma3_text", "gpt_neox", "llama"]


def stream(model, *, follow: bool, step=decode_logits, sinks: int = SINKS) -> tuple[float, float]:
    """(max |logit difference|, top-1 agreement) between the sink cache and the reference."""
    generator = torch.Generator().manual_seed(1)
    device = model.get_input_embeddings().weight.device
    tokens = torch.randint(3, VOCAB, (PROMPT + DECODE_STEPS + 200,), generator=generator).to(device)
    steps = [PROMPT] + [7 if i % 250 == 125 else 1 for i in range(DECODE_STEPS)]
    real, reference = SinkCache.for_model(model, sinks, WINDOW), NaiveSinkCache(model, sinks, WINDOW)
    worst, agreed, fed = 0.0, 0, 0
    with torch.inference_mode():
        for count in steps:
            ids = tokens[fed : fed + count][None]
            fed += count
            if count == 1 and real.ledger.sinks_full:
                with real.decode_pass():
                    ours = step(model, real, ids)[0, -1].float()
            else:
                ours = forward(model, real, ids).logits[0, -1].float()
            reference.evict_for_space(count)
            if follow:
                reference.follow(real.get_seq_length() - count)
            theirs = model(ids, cache=reference).logits[0, -1].float()
            worst = max(worst, (ours - theirs).abs().max().item())
            agreed += int(ours.argmax() == theirs.argmax())
    return worst, agreed / len(steps)


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_float32_logits_match_the_paper_reference(model_type):
    worst, _ = stream(tiny_model(model_type), follow=False)
    assert worst <= 1e-3


@pytest.mark.parametrize("model_type", sorted(SUPPORTED_MODEL_TYPES))
def test_bfloat16_top1_agrees_with_the_reference(model_type):
    # The reference is moved into our position frame (every in-cache distance unchanged):
    # otherwise the model's own bf16 RoPE, which rounds cos and sin differently at each
    # position, would flip near-ties for reasons unrelated to either cache.
    _, agreement = stream(tiny_model(model_type, dtype=torch.bfloat16), follow=True)
    assert agreement >= 0.99


@pytest.mark.parametrize("model_type", KEPT_TYPES)
def test_a_kept_prefix_of_40_tokens_streams_like_4_sinks(model_type):
    worst, _ = stream(tiny_model(model_type), follow=False, sinks=KEPT)
    assert worst <= 1e-3
    _, agreement = stream(tiny_model(model_type, dtype=torch.bfloat16), follow=True, sinks=KEPT)
    assert agreement >= 0.99


@pytest.mark.parametrize("rope_scaling", sorted(ROPE_SCALINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_scaling_streams_exactly(rope_scaling, dtype):
    worst, agreement = stream(tiny_model("llama", rope_scaling=rope_scaling, dtype=dtype), follow=True)
    if dtype == torch.float32:
        assert worst <= 1e-3
    else:
        assert agreement >= 0.99


def test_layers_keep_the_models_own_sliding_window_when_it_is_narrower():
    cache = SinkCache.for_model(tiny_model("gemma2"), SINKS, WINDOW)  # sliding window 24, then full
    assert [type(layer) for layer in cache.layers] == [SlidingLayer, SinkLayer]
    wide = SinkCache.for_model(tiny_model("phi3"), SINKS, WINDOW)  # sliding window 2047 never binds
    assert {type(layer) for layer in wide.layers} == {SinkLayer}


# Rotate-half, a model's own sliding window with eager attention, interleaved pairs.
CUDA_TYPES = ["llama", "gemma2", "cohere"]


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", CUDA_TYPES)
def test_on_cuda_with_sdpa_float32_logits_match_and_bfloat16_top1_agrees(model_type):
    model = copy.deepcopy(tiny_model(model_type)).to("cuda")
    worst, _ = stream(model, follow=False)
    assert worst <= 1e-3
    _, agreement = stream(copy.deepcopy(tiny_model(model_type, dtype=torch.bfloat16)).to("cuda"), follow=True)
    assert agreement >= 0.99


@pytest.mark.cuda
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_on_cuda_the_compiled_decode_step_matches_the_reference(model_type):
    model = copy.deepcopy(tiny_model(model_type)).to("cuda")
    compiled = torch.compile(decode_logits, mode="reduce-overhead", fullgraph=True, dynamic=False)

    def step(model, cache, ids):
        cache.static_extent = True
        cache.mark_static()
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(model, cache, ids).clone()

    torch._dynamo.reset()
    worst, _ = stream(model, follow=False, step=step)
    assert worst <= 1e-3


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_weights_stream_exactly(method, dtype):
    # The same quantized model on both sides: the cache must not care how the weights are stored.
    model = copy.deepcopy(tiny_model("llama", dtype=dtype))
    dtype_name = str(dtype).removeprefix("torch.")
    quantized = quantize_model(model, plan_quantization(method, "cpu", dtype_name, Accelerators()))
    assert quantized > 0
    worst, agreement = stream(model, follow=dtype == torch.bfloat16)
    if dtype == torch.float32:
        assert worst <= 1e-3
    else:
        assert agreement >= 0.99
