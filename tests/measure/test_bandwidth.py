"""The bandwidth limit's bytes: what a decode step reads of the weights and of the cache."""

import copy

import torch

from streamchat.measure import bandwidth
from streamchat.placement.device import Accelerators
from streamchat.placement.quantization import plan_quantization, quantize_model
from tests.support.models import tiny_model


def test_weight_bytes_count_what_a_step_reads():
    model = tiny_model("llama")  # untied: the input embedding table is read one row at a time
    embedding = model.get_input_embeddings().weight
    everything = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert bandwidth.weight_bytes_per_token(model) == everything - embedding.numel() * 4


def test_quantized_weights_count_by_their_storage():
    model = copy.deepcopy(tiny_model("llama", dtype=torch.bfloat16))
    before = bandwidth.weight_bytes_per_token(model)
    quantize_model(model, plan_quantization("int8", "cpu", "bfloat16", Accelerators()))
    after = bandwidth.weight_bytes_per_token(model)
    # int8 weights are half of bf16's bytes, plus one bf16 scale per output row.
    assert 0.45 * before < after < 0.6 * before


def test_kv_bytes_follow_the_config():
    model = tiny_model("llama")  # 2 layers, 2 KV heads of 16 dims
    assert bandwidth.kv_bytes_per_token(model, context=100, element_bytes=2) == 2 * 2 * 2 * 16 * 100 * 2
