"""The weights' fingerprint: the same for the same files and layout, different when either changes."""

import copy
import json

import torch

from streamchat.loading.identity import quantization_of, weights_fingerprint
from tests.support.models import tiny_model


def saved_model(directory):
    model = tiny_model("llama")
    model.save_pretrained(directory)
    return model


def test_the_same_files_and_layout_give_the_same_fingerprint(tmp_path):
    model = saved_model(tmp_path / "m")
    assert weights_fingerprint(tmp_path / "m", model) == weights_fingerprint(tmp_path / "m", copy.deepcopy(model))


def test_other_files_another_place_or_another_dtype_change_it(tmp_path):
    model = saved_model(tmp_path / "m")
    before = weights_fingerprint(tmp_path / "m", model)
    assert weights_fingerprint(tmp_path / "m", copy.deepcopy(model).to(torch.bfloat16)) != before
    saved_model(tmp_path / "elsewhere")
    assert weights_fingerprint(tmp_path / "elsewhere", model) != before
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert weights_fingerprint(tmp_path / "m", model) != before


def test_rewritten_weights_of_another_shape_change_it(tmp_path):
    model = saved_model(tmp_path / "m")
    before = weights_fingerprint(tmp_path / "m", model)
    tiny_model("llama", vocab_size=300).save_pretrained(tmp_path / "m")  # the safetensors header changes
    assert weights_fingerprint(tmp_path / "m", model) != before


def test_quantization_is_read_from_the_config():
    model = copy.deepcopy(tiny_model("llama"))
    assert quantization_of(model) == "none"
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    assert quantization_of(model) == "bitsandbytes"
