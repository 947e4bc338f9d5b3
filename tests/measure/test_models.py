"""--random-init: known shapes without weights, from a preset, a config.json or a model type."""

import json

import pytest
import torch

from streamchat.errors import ConfigError, UnsupportedModelError
from streamchat.measure.models import PRESETS, random_config, random_model


def test_the_llama_2_7b_preset_is_the_papers_model():
    config = random_config("llama-2-7b")
    assert config.model_type == "llama"
    shape = (config.hidden_size, config.intermediate_size, config.num_hidden_layers, config.num_attention_heads)
    assert shape == (4096, 11008, 32, 32)
    assert (config.num_key_value_heads, config.vocab_size, config.max_position_embeddings) == (32, 32000, 4096)


def test_the_cpu_sized_presets_are_smollm2_1_7b_and_llama_3_2_1b():
    smollm = random_config("smollm2-1.7b")
    shape = (smollm.hidden_size, smollm.intermediate_size, smollm.num_hidden_layers, smollm.num_attention_heads)
    assert (smollm.model_type, *shape) == ("llama", 2048, 8192, 24, 32)
    assert (smollm.num_key_value_heads, smollm.vocab_size, smollm.tie_word_embeddings) == (32, 49152, True)
    llama = random_config("llama-3.2-1b")
    shape = (llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers, llama.num_attention_heads)
    assert (llama.model_type, *shape) == ("llama", 2048, 8192, 16, 32)
    assert (llama.num_key_value_heads, llama.head_dim, llama.vocab_size, llama.tie_word_embeddings) == (
        8,
        64,
        128256,
        True,
    )
    assert llama.rope_parameters["rope_type"] == "llama3" and llama.rope_parameters["factor"] == 32.0


def test_the_llama_3_2_1b_shape_builds_a_tied_grouped_query_model_at_tiny_scale(monkeypatch):
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 256}
    monkeypatch.setitem(PRESETS, "llama-3.2-1b", PRESETS["llama-3.2-1b"] | small)
    model = random_model("llama-3.2-1b", "cpu", "float32").model
    attention = model.model.layers[0].self_attn
    assert (attention.q_proj.out_features, attention.k_proj.out_features) == (32 * 64, 8 * 64)
    assert model.lm_head.weight is model.get_input_embeddings().weight
    assert model.model.rotary_emb.rope_type == "llama3"


def test_every_preset_builds_a_config():
    for name in PRESETS:
        assert random_config(name).model_type == PRESETS[name]["model_type"]


def test_a_config_json_or_its_directory_or_a_model_type(tmp_path):
    fields = {"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1, "architectures": ["Qwen2ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps(fields), encoding="utf-8")
    for spec in (str(tmp_path / "config.json"), str(tmp_path)):
        config = random_config(spec)
        assert (config.model_type, config.hidden_size, config.num_hidden_layers) == ("qwen2", 32, 1)
    assert random_config("mistral").model_type == "mistral"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "is not a readable JSON config"),
        ("[1, 2]", "holds no JSON object"),
        ('{"hidden_size": 8}', "model_type None is not a transformers model type"),
    ],
)
def test_bad_config_files_are_refused(tmp_path, content, message):
    path = tmp_path / "shape.json"
    if content is not None:
        path.write_text(content, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        random_config(str(path))


def test_random_weights_come_seeded_on_the_device_asked():
    first, second = random_model("tiny", "cpu", "float32"), random_model("tiny", "auto", "float32")
    assert (first.name, first.device, first.dtype) == ("random tiny", torch.device("cpu"), torch.float32)
    weight = first.model.get_input_embeddings().weight
    assert torch.equal(weight, second.model.get_input_embeddings().weight) and weight.std() > 0
    assert random_model("tiny", "cpu", "bfloat16").dtype == torch.bfloat16


def test_architectures_the_sink_cache_cannot_serve_are_refused():
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        random_model("gpt2", "cpu", "float32")


def test_random_weights_are_fused_as_a_load_fuses_them_so_the_lean_step_runs():
    from streamchat.placement.fusion import FusedProjection
    from streamchat.placement.lean_forward import lean_forward_for

    model = random_model("tiny", "cpu", "float32").model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, FusedProjection)
    assert lean_forward_for(model) is not None


def test_random_weights_count_their_parameters_before_quantizing_as_a_load_counts_them():
    # tiny: 256 x 64 embeddings and head; per layer q, o 64 x 64, k, v 32 x 64, three 64 x 128 MLP weights, two norms.
    expected = 2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 64 * 128 + 2 * 64) + 64
    quantized = random_model("tiny", "cpu", "bfloat16", "int8")
    assert quantized.quantization == "int8" and quantized.model.num_parameters() < expected  # weights now buffers
    assert quantized.parameters == random_model("tiny", "cpu", "float32").parameters == expected == 106_816
