"""scripts/real_size_models.py in a tiny shape: each format's files load and hold the tensors asked for."""

from __future__ import annotations

import json

import gguf
import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from tests.support.scripts import load_script

real_size_models = load_script("real_size_models")

# Above the tokenizer's 600 tokens, so the GGUF's vocabulary gets filler tokens too.
TINY = ["--layers", "1", "--hidden", "64", "--intermediate", "128", "--vocab", "1024"]


@pytest.mark.parametrize("preset", ["smollm2-1.7b", "llama-2-7b"])  # tied head, then untied
def test_safetensors_directory_holds_the_models_tensors_in_indexed_shards(tmp_path, preset):
    out = tmp_path / "model"
    real_size_models.main([preset, "safetensors-bf16", str(out), *TINY])

    config = AutoConfig.from_pretrained(out)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 1, 1024)
    assert config.dtype == torch.bfloat16
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in LlamaForCausalLM(config).state_dict().items()}
    if config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert ("lm_head.weight" in expected) == (preset == "llama-2-7b")

    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(expected)
    found = {}
    for shard in set(index["weight_map"].values()):
        assert (out / shard).is_file()
        with safe_open(str(out / shard), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  # safe_open handles are not iterable
                assert index["weight_map"][name] == shard
                tensor = handle.get_tensor(name)
                assert tensor.dtype == torch.bfloat16
                found[name] = tuple(tensor.shape)
    assert found == expected
    assert index["metadata"]["total_size"] == 2 * sum(torch.Size(shape).numel() for shape in expected.values())
    assert AutoTokenizer.from_pretrained(out).chat_template is not None


@pytest.mark.parametrize("file_format", ["gguf-q8_0", "gguf-q4_0", "gguf-q4_1"])
def test_gguf_file_loads_its_config_with_the_types_asked(tmp_path, file_format):
    out = tmp_path / "model.gguf"
    real_size_models.main(["smollm2-1.7b", file_format, str(out), *TINY])

    config = AutoConfig.from_pretrained(tmp_path, gguf_file=out.name)
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (64, 1, 1024)
    assert config.tie_word_embeddings
    assert len(AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)) == 1024

    asked = real_size_models.GGUF_TYPES[file_format]
    types = {tensor.name: tensor.tensor_type for tensor in gguf.GGUFReader(out).tensors}
    assert "output.weight" not in types  # tied to the embedding
    embedding = gguf.GGMLQuantizationType.Q8_0  # beside 4-bit matrices too, as the default model's file
    assert types.pop("token_embd.weight") == embedding
    for name, ggml_type in types.items():
        assert ggml_type == (gguf.GGMLQuantizationType.F32 if name.endswith("norm.weight") else asked), name
    assert len(types) == 10  # one block's nine tensors and the output norm


def test_gguf_untied_head_is_written_as_output(tmp_path):
    out = tmp_path / "model.gguf"
    real_size_models.main(["llama-2-7b", "gguf-q4_0", str(out), *TINY])

    assert not AutoConfig.from_pretrained(tmp_path, gguf_file=out.name).tie_word_embeddings
    shapes = {tensor.name: tuple(tensor.shape) for tensor in gguf.GGUFReader(out).tensors}
    assert shapes["output.weight"] == (64, 1024)  # ggml order: (in, out)
