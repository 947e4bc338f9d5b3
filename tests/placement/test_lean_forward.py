"""The lean decode pass gives the model's own logits: through the sink cache, and for rows at different positions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch._dynamo
from transformers import DynamicCache

from streamchat.cache import SinkCache, forward
from streamchat.engine.compiled_decode import decode_function, decode_logits
from streamchat.generation.decoder import Decoder
from streamchat.generation.requests import endless_reply
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.placement.device import Accelerators
from streamchat.placement.fusion import fuse_projections
from streamchat.placement.lean_forward import lean_forward_for
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.support.models import VOCAB, tiny_model

SINKS, WINDOW, PROMPT, STEPS = 4, 30, 20, 60


def fused_copy(model: torch.nn.Module, quantize: str = "none") -> torch.nn.Module:
    fused = copy.deepcopy(model)
    fuse_projections(fused)
    dtype = str(model.dtype).removeprefix("torch.")
    quantize_model(fused, plan_quantization(quantize, "cpu", dtype, Accelerators()))
    return fused


def side_by_side(reference: torch.nn.Module, fused: torch.nn.Module) -> float:
    """Decode STEPS greedy tokens through two sink caches (evicting, rebasing): the model's forward on
    `reference`, the lean one on `fused`, both fed the reference's tokens; the largest logit difference."""
    lean = lean_forward_for(fused)
    ours, theirs = SinkCache.for_model(fused, SINKS, WINDOW), SinkCache.for_model(reference, SINKS, WINDOW)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    expected = forward(reference, theirs, prompt).logits
    forward(fused, ours, prompt)
    worst = 0.0
    for _ in range(STEPS):
        token = expected[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        with theirs.decode_pass():
            expected = decode_logits(reference, theirs, token)
        with ours.decode_pass():
            inputs = ours.decode_inputs(token)
            got = lean(token, inputs.position_ids, inputs.attention_mask, ours)
        assert got.shape == expected.shape == (1, 1, VOCAB)
        worst = max(worst, (got.float() - expected.float()).abs().max().item())
    assert ours.stats().evicted > 0 and ours.ledger.position_offset > 0  # evicted and rebased on the way
    return worst


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_through_the_sink_cache_the_lean_forward_gives_the_models_own_logits(model_type, dtype):
    model = tiny_model(model_type, dtype=dtype)
    # The same operations in the same dtypes: not merely close, equal.
    assert side_by_side(model, fused_copy(model)) == 0.0


@pytest.mark.parametrize("rope_scaling", ["llama3", "yarn"])
def test_scaled_rotary_geometries_give_the_models_own_logits(rope_scaling):
    model = tiny_model("llama", rope_scaling=rope_scaling)
    assert side_by_side(model, fused_copy(model)) == 0.0


def test_int8_weights_give_the_int8_models_own_logits():
    model = tiny_model("llama", dtype=torch.bfloat16)
    separate = copy.deepcopy(model)
    quantize_model(separate, plan_quantization("int8", "cpu", "bfloat16", Accelerators()))
    # Fused and quantized per row: the same int8 weights, one product instead of three; bf16 sums may round apart.
    worst = side_by_side(separate, fused_copy(model, "int8"))
    scale = forward(separate, SinkCache.for_model(separate, SINKS, WINDOW), torch.tensor([[5, 6, 7, 8]])).logits
    assert worst <= 0.02 * scale.abs().max().item()


def test_rows_at_different_positions_under_different_masks_each_get_their_own_logits():
    model = tiny_model("llama")
    fused = fused_copy(model)
    lean = lean_forward_for(fused)
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(3, VOCAB, (2, 12), generator=generator)
    # Row 0 holds 12 tokens; row 1 only its last 7 (left padding), at positions 0..6.
    held = torch.ones(2, 12, dtype=torch.bool)
    held[1, :5] = False
    positions = torch.stack((torch.arange(12), (torch.arange(12) - 5).clamp(min=0)))
    caches = DynamicCache(), DynamicCache()
    with torch.inference_mode():
        for cache in caches:
            model(input_ids=prompts, attention_mask=held.long(), position_ids=positions, cache=cache)
        token = torch.tensor([[9], [40]])  # [2, 1]
        step_positions = torch.tensor([[12], [7]])
        mask = torch.cat((held, torch.ones(2, 1, dtype=torch.bool)), dim=1)[:, None, None]  # [2, 1, 1, 13]
        expected = model(
            input_ids=token, position_ids=step_positions, attention_mask=mask, cache=caches[0], logits_to_keep=1
        ).logits
        got = lean(token, step_positions, mask, caches[1])
        # Each row alone: what a batch of one gives.
        alone = model(
            input_ids=token[1:], position_ids=step_positions[1:], attention_mask=mask[1:], cache=_row(caches[0], 1)
        ).logits
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1:], alone, rtol=1e-5, atol=1e-5)


def _row(cache: DynamicCache, row: int) -> DynamicCache:
    """Row `row` of a batch's cache, without its last token (the step writes it again)."""
    single = DynamicCache()
    for index, layer in enumerate(cache.layers):
        single.update(layer.keys[row : row + 1, :, :-1], layer.values[row : row + 1, :, :-1], index)
    return single


@pytest.mark.parametrize("model_type", ["gemma2", "olmo2", "granite", "phi3"])
def test_other_families_have_no_lean_forward(model_type):
    assert lean_forward_for(fused_copy(tiny_model(model_type))) is None


def test_an_unfused_model_has_no_lean_forward():
    assert lean_forward_for(tiny_model("llama")) is None


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_the_compiled_lean_forward_is_one_graph_that_never_recompiles_and_matches_eager(quantize):
    fused = fused_copy(tiny_model("llama", dtype=torch.bfloat16), quantize)
    greedy = GenerationSettings(temperature=0.0)
    eager = stream(fused, None, greedy)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = stream(fused, "aot_eager", greedy)  # fullgraph=True: a graph break would raise
    assert compiled == eager
    assert len(set(eager)) > 2


def stream(model: torch.nn.Module, backend: str | None, settings: GenerationSettings) -> list[int]:
    """STEPS tokens through SINKS + WINDOW slots after a PROMPT-token prompt, by the decoder (the lean forward)."""
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    assert decode_function(model) is not decode_logits  # the lean forward, compiled or not
    decoder = Decoder(cache)
    prompt = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    decoder.start(forward(model, cache, prompt).logits, settings, Sampler(seed=11))
    next_token = endless_reply(model, decoder, backend)
    return [next_token().token for _ in range(STEPS)]
