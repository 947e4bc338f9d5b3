import copy

import pytest
import torch

from streamchat.placement.device import Accelerators
from streamchat.placement.fusion import FusedProjection, ProjectionPart, fuse_projections
from streamchat.placement.int4_linear import Int4Linear
from streamchat.placement.int8_linear import Int8Linear
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.support.models import tiny_config, tiny_model

IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 200, 11]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.inference_mode():
        return model(IDS).logits.float()


def fresh(model_type: str = "llama", dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return copy.deepcopy(tiny_model(model_type, dtype=dtype))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_fused_layers_hold_the_separate_weights_side_by_side_and_the_model_predicts_exactly_as_before(model_type):
    model = fresh(model_type)
    attention = model.model.layers[0].self_attn
    separate = [attention.q_proj.weight.clone(), attention.k_proj.weight.clone(), attention.v_proj.weight.clone()]
    expected = logits(model)
    assert fuse_projections(model) == 2 * 2  # two layers, each qkv and gate_up
    qkv = attention.qkv_proj
    assert isinstance(qkv, FusedProjection) and isinstance(attention.k_proj, ProjectionPart)
    assert torch.equal(qkv.linear.weight, torch.cat(separate))
    assert (qkv.linear.bias is not None) == (model_type == "qwen2")  # qwen2's q/k/v have biases
    assert torch.equal(logits(model), expected)
    # One copy of the weights: the parts hold none.
    assert sum(parameter.numel() for parameter in model.parameters()) == tiny_model(model_type).num_parameters()


def test_the_fused_product_is_computed_once_per_input_and_nothing_is_held_after():
    model = fresh()
    fuse_projections(model)
    mlp = model.model.layers[0].mlp
    calls = []
    mlp.gate_up_proj.linear.register_forward_hook(lambda *args: calls.append(1))
    hidden = torch.randn(1, 3, 64)
    gate, up = mlp.gate_proj(hidden), mlp.up_proj(hidden)
    assert calls == [1]
    assert torch.equal(torch.cat((gate, up), dim=-1), mlp.gate_up_proj.linear(hidden))
    assert mlp.gate_up_proj._input is None
    mlp.gate_proj(hidden.clone())  # another input: computed again
    assert len(calls) == 3


def whole_int4_blocks(dtype: torch.dtype) -> torch.nn.Module:
    """A tiny llama whose k and v are as wide as q: every projection is whole int4 blocks on any CPU (64 outputs)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama", num_key_value_heads=4)).to(dtype).eval()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_after_fusing_the_model_predicts_as_the_separately_quantized_one(method):
    separate, fused = whole_int4_blocks(torch.bfloat16), whole_int4_blocks(torch.bfloat16)
    plan = plan_quantization(method, "cpu", "bfloat16", Accelerators())
    quantize_model(separate, plan)
    fuse_projections(fused)
    # q/k/v and gate/up are one layer each now: 2 layers x (qkv, o, gate_up, down) + the head + the input embedding.
    assert quantize_model(fused, plan) == 2 * 4 + 2
    if method == "int8":
        assert isinstance(fused.model.layers[0].self_attn.qkv_proj.linear, Int8Linear)
        # Per output row: the fused rows are the separate layers' rows, exactly.
        attention = separate.model.layers[0].self_attn
        expected = torch.cat([attention.q_proj.weight_int8, attention.k_proj.weight_int8, attention.v_proj.weight_int8])
        assert torch.equal(fused.model.layers[0].self_attn.qkv_proj.linear.weight_int8, expected)
    else:
        assert isinstance(fused.model.layers[0].mlp.gate_up_proj.linear, Int4Linear)
    expected, got = logits(separate), logits(fused)
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()


@pytest.mark.parametrize("model_type", ["gemma", "olmo2", "granite", "phi3"])
def test_other_families_are_left_unfused(model_type):
    model = fresh(model_type)
    assert fuse_projections(model) == 0
    assert not any(isinstance(module, FusedProjection) for module in model.modules())


def test_fusing_twice_changes_nothing():
    model = fresh()
    fuse_projections(model)
    assert fuse_projections(model) == 0
