"""What --tp accepts: models with a tensor-parallel plan, unquantized weights, no --device-map."""

import pytest

from streamchat.errors import ConfigError, UnsupportedModelError
from streamchat.placement.tensor_parallel import (
    ensure_heads_split,
    ensure_no_device_map,
    ensure_tensor_parallel_plan,
    tensor_parallel_model_types,
    tensor_parallel_quantization,
)
from tests.support.models import tiny_config


def test_models_with_a_plan_are_accepted_and_the_others_refused_with_the_list():
    ensure_tensor_parallel_plan(tiny_config("llama"), "tiny-llama")
    with pytest.raises(UnsupportedModelError) as refused:
        ensure_tensor_parallel_plan(tiny_config("stablelm"), "tiny-stablelm")
    message = str(refused.value)
    assert message.startswith("tiny-stablelm (stablelm) has no tensor-parallel plan in transformers")
    assert message.endswith(f"model types with one: {', '.join(tensor_parallel_model_types())}")
    assert "llama" in tensor_parallel_model_types() and "stablelm" not in tensor_parallel_model_types()


def test_quantize_auto_means_none_and_int8_or_int4_are_refused():
    assert tensor_parallel_quantization("auto") == "none"
    assert tensor_parallel_quantization("none") == "none"
    for method in ("int8", "int4"):
        with pytest.raises(ConfigError, match=f"--quantize {method} cannot be used with --tp"):
            tensor_parallel_quantization(method)


def test_device_map_is_refused_in_one_line_that_says_which_to_pick():
    ensure_no_device_map(None)
    with pytest.raises(ConfigError) as refused:
        ensure_no_device_map("auto")
    assert "\n" not in str(refused.value)
    assert str(refused.value).startswith("--tp and --device-map auto both spread the model; give one of them")


def test_heads_must_split_evenly_and_the_message_says_which_tp_would():
    ensure_heads_split(tiny_config("llama"), 2, "tiny")  # 4 heads, 2 KV heads
    config = tiny_config("llama", num_attention_heads=9, num_key_value_heads=3, hidden_size=72, head_dim=8)
    with pytest.raises(ConfigError) as refused:
        ensure_heads_split(config, 2, "SmolLM2-135M-Instruct")
    assert str(refused.value) == (
        "--tp 2: SmolLM2-135M-Instruct has 9 attention heads and 3 KV heads, which do not split evenly "
        "over 2 processes; use --tp 3"
    )
