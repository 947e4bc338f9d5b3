"""aten calls counted by the profiler: each operator called from Python once, not what it calls inside."""

import torch
from transformers import AutoModelForCausalLM

from streamchat.loading.loader import attention_implementation
from streamchat.measure.aten_calls import aten_calls, decode_aten_calls_per_token
from tests.support.models import VOCAB, tiny_config


def test_operators_called_from_python_count_once_each():
    ones = torch.ones(3)
    assert aten_calls(lambda: None) == 0
    assert aten_calls(lambda: ones + 1) == 1
    # ones, ones, mm: what torch.ones does inside (empty, fill_) is not counted again.
    assert aten_calls(lambda: torch.mm(torch.ones(2, 2), torch.ones(2, 2))) == 3


def _model(layers: int):
    config = tiny_config("llama", num_hidden_layers=layers)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attention_implementation(config)).eval()


def test_a_decode_step_counts_the_same_every_time_and_each_layer_adds_its_calls():
    ids = torch.randint(3, VOCAB, (1, 30), generator=torch.Generator().manual_seed(0))
    two, four, six = (decode_aten_calls_per_token(_model(layers), ids, 4, 60) for layers in (2, 4, 6))
    assert two > 0 and decode_aten_calls_per_token(_model(2), ids, 4, 60) == two
    assert four - two == six - four > 0  # the same calls per layer
