import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from streamchat.errors import (
    ConfigError,
    ModelAccessError,
    ModelNotFoundError,
    OutOfMemoryError,
    UnsupportedModelError,
)
from streamchat.loading import LoadedModel, LoadOptions, load_model
from streamchat.loading.conversion import cache_root, conversion_dir
from streamchat.loading.loader import attention_implementation
from streamchat.placement.attention import ATTENTION_NAME
from streamchat.placement.device import native_kernels_run_here
from streamchat.placement.native_layers import TiledInt4Linear, TiledInt8Linear
from tests.support.gguf_files import CONTEXT_LENGTH, save_model_directory, write_tiny_gguf

PROMPT = [{"role": "user", "content": "hello world"}]
TINY_PARAMETERS = 27008


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A plain transformers model directory: the tiny GGUF as transformers reads it, saved once for this module."""
    root = tmp_path_factory.mktemp("model")
    yield save_model_directory(write_tiny_gguf(root / "tiny.gguf"), root / "tiny-model")


def logits(loaded: LoadedModel) -> torch.Tensor:
    ids = loaded.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        return loaded.model(input_ids=ids["input_ids"].to(loaded.device)).logits.float()


def test_a_gguf_loads_exactly_as_transformers_reads_it(tmp_path: Path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    notes: list[str] = []
    # float32 and unquantized, as transformers reads it: this test is about the conversion.
    loaded = load_model(LoadOptions(model=str(gguf), dtype="float32", quantize="none"), notify=notes.append)

    assert len(notes) == 1
    assert loaded.source.kind == "gguf"
    assert loaded.directory == conversion_dir(gguf)
    assert loaded.model_type == "llama"
    assert (loaded.device, loaded.dtype) == (torch.device("cpu"), torch.float32)
    assert (loaded.max_context, loaded.parameters) == (CONTEXT_LENGTH, TINY_PARAMETERS)
    assert loaded.has_chat_template
    assert loaded.model.config._attn_implementation == ATTENTION_NAME
    assert loaded.load_seconds > 0

    reference_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=gguf.name)
    reference_tokenizer = AutoTokenizer.from_pretrained(tmp_path, gguf_file=gguf.name)
    rendered = reference_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert loaded.tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False) == rendered
    assert loaded.tokenizer(rendered).input_ids == reference_tokenizer(rendered).input_ids
    ids = reference_tokenizer(rendered, return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(loaded.model(input_ids=ids).logits, reference_model(input_ids=ids).logits)


def test_a_model_directory_loads_in_the_requested_dtype(model_dir: Path):
    loaded = load_model(LoadOptions(model=str(model_dir), dtype="bfloat16"))
    assert (loaded.source.kind, loaded.directory) == ("directory", model_dir)
    assert loaded.dtype == torch.bfloat16
    assert all(parameter.dtype == torch.bfloat16 for parameter in loaded.model.parameters())


def test_pickled_weights_load_only_with_allow_pickle(model_dir: Path, tmp_path: Path):
    pickled = shutil.copytree(model_dir, tmp_path / "pickled")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()

    with pytest.raises(ModelAccessError) as raised:
        load_model(LoadOptions(model=str(pickled)))
    assert str(raised.value) == (
        f"{pickled} has no safetensors weights (model*.safetensors). If it ships pickled weights "
        "(pytorch_model*.bin) and you trust its publisher, pass --allow-pickle."
    )
    allowed = load_model(LoadOptions(model=str(pickled), allow_pickle=True))
    assert torch.equal(logits(allowed), logits(load_model(LoadOptions(model=str(model_dir)))))


def test_a_directory_without_weights_is_refused(model_dir: Path, tmp_path: Path):
    empty = tmp_path / "empty"
    empty.mkdir()
    shutil.copy(model_dir / "config.json", empty)
    with pytest.raises(ModelAccessError, match=r"has no safetensors weights"):
        load_model(LoadOptions(model=str(empty), allow_pickle=False))
    with pytest.raises(ModelAccessError, match=r"has no weights: found neither model\*\.safetensors nor"):
        load_model(LoadOptions(model=str(empty), allow_pickle=True))


def test_damaged_weights_are_refused_by_name(model_dir: Path, tmp_path: Path):
    damaged = shutil.copytree(model_dir, tmp_path / "damaged")
    weights = damaged / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(ModelAccessError) as raised:
        load_model(LoadOptions(model=str(damaged)))
    assert str(raised.value) == (
        f"{weights} is truncated or corrupt: incomplete metadata, file not fully covered; "
        "delete it and download the model again"
    )


def test_a_quantized_model_is_packed_once_and_later_starts_read_the_packed_copy(tmp_path: Path):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    options = LoadOptions(model=str(gguf), dtype="bfloat16", quantize="int4")
    first = load_model(options)
    later = load_model(options)

    assert (first.weights_from, later.weights_from) == ("files", "packed copy")
    (copy,) = (cache_root() / "packed").rglob("*.safetensors")
    assert torch.equal(logits(first), logits(later))
    assert first.parameters == later.parameters == TINY_PARAMETERS

    copy.write_bytes(b"damaged")  # a copy cut short or garbled is packed again, not an error
    again = load_model(options)
    assert again.weights_from == "files"
    assert torch.equal(logits(again), logits(first))
    assert load_model(options).weights_from == "packed copy"


def test_a_quantized_models_q8_0_embedding_is_the_files_own_at_first_and_later_starts(tmp_path: Path):
    import gguf as gguf_py
    from gguf.quants import dequantize

    path = write_tiny_gguf(tmp_path / "tiny.gguf", embedding_type=gguf_py.GGMLQuantizationType.Q8_0)
    (tensor,) = [t for t in gguf_py.GGUFReader(path).tensors if t.name == "token_embd.weight"]
    table = torch.from_numpy(dequantize(tensor.data, gguf_py.GGMLQuantizationType.Q8_0))  # [vocab, hidden]
    ids = torch.arange(table.shape[0])[None]
    options = LoadOptions(model=str(path), dtype="float32", quantize="int4")
    for start in ("files", "packed copy"):
        loaded = load_model(options)
        assert loaded.weights_from == start
        assert torch.equal(loaded.model.get_input_embeddings()(ids)[0], table)


@pytest.mark.skipif(not native_kernels_run_here(), reason="needs streamchat's CPU kernels (AVX2 and a C compiler)")
def test_a_q8_0_gguf_keeps_its_blocks_in_int8_layers_unless_int4_is_asked_for(tmp_path: Path):
    import gguf as gguf_py
    from gguf.quants import dequantize

    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=gguf_py.GGMLQuantizationType.Q8_0)
    (tensor,) = [t for t in gguf_py.GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight"]
    down = torch.from_numpy(dequantize(tensor.data, gguf_py.GGMLQuantizationType.Q8_0))  # [hidden, intermediate]
    for start in ("files", "packed copy"):
        loaded = load_model(LoadOptions(model=str(path), dtype="bfloat16"))  # --quantize auto
        layer = loaded.model.model.layers[0].mlp.down_proj
        assert (loaded.weights_from, loaded.quantization) == (start, "int8")
        assert isinstance(layer, TiledInt8Linear) and torch.equal(layer.widened(torch.float32), down)
    asked = load_model(LoadOptions(model=str(path), dtype="bfloat16", quantize="int4"))
    assert asked.quantization == "int4" and isinstance(asked.model.model.layers[0].mlp.down_proj, TiledInt4Linear)


def test_an_unquantized_model_is_read_from_its_files_at_every_start(model_dir: Path):
    for _ in range(2):
        assert load_model(LoadOptions(model=str(model_dir), dtype="float32", quantize="none")).weights_from == "files"
    assert not (cache_root() / "packed").exists()


@pytest.mark.parametrize(
    ("model_type", "attention"), [("llama", ATTENTION_NAME), ("gemma2", "eager"), ("qwen2", ATTENTION_NAME)]
)
def test_attention_is_streamchat_sdpa_unless_the_model_lacks_sdpa(model_type: str, attention: str):
    assert attention_implementation(AutoConfig.for_model(model_type)) == attention


def write_config(directory: Path, **config: object) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_an_unsupported_architecture_is_refused_before_its_weights_are_looked_at(tmp_path: Path):
    gpt2 = write_config(tmp_path / "gpt2", model_type="gpt2")
    with pytest.raises(UnsupportedModelError, match="model type 'gpt2' cannot stream") as raised:
        load_model(LoadOptions(model=str(gpt2)))
    assert raised.value.exit_code == 5


def test_a_model_type_transformers_does_not_know_is_unsupported(tmp_path: Path):
    unknown = write_config(tmp_path / "unknown", model_type="frobnicator")
    with pytest.raises(UnsupportedModelError, match=r"has model type `frobnicator` but Transformers does not"):
        load_model(LoadOptions(model=str(unknown)))


def test_a_broken_config_is_not_a_usable_model(tmp_path: Path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match=r"broken is not a usable model: It looks like the config file"):
        load_model(LoadOptions(model=str(broken)))


def test_custom_code_runs_only_with_trust_remote_code(tmp_path: Path):
    custom = write_config(
        tmp_path / "custom",
        model_type="custom",
        auto_map={"AutoConfig": "configuration_custom.CustomConfig"},
    )
    marker = tmp_path / "custom-code-ran"
    (custom / "configuration_custom.py").write_text(
        "from pathlib import Path\n"
        "from transformers import PretrainedConfig\n"
        f"Path({str(marker)!r}).touch()\n"
        "class CustomConfig(PretrainedConfig):\n"
        "    model_type = 'custom'\n"
    )
    with pytest.raises(UnsupportedModelError, match=r"Pass --trust-remote-code if you trust its code\.$"):
        load_model(LoadOptions(model=str(custom)))
    assert not marker.exists()

    with pytest.raises(UnsupportedModelError, match="model type 'custom' cannot stream"):
        load_model(LoadOptions(model=str(custom), trust_remote_code=True))
    assert marker.exists()


def test_a_model_too_large_for_memory_is_reported_as_such(model_dir: Path, tmp_path: Path):
    huge = shutil.copytree(model_dir, tmp_path / "huge")
    config = json.loads((huge / "config.json").read_text())
    # Ten billion tokens of embeddings (1.3 TB): refused before a weight is read.
    config["vocab_size"] = 10_000_000_000
    (huge / "config.json").write_text(json.dumps(config))
    save_file({"model.norm.weight": torch.ones(config["hidden_size"])}, huge / "model.safetensors")

    with pytest.raises(OutOfMemoryError) as raised:
        load_model(LoadOptions(model=str(huge), dtype="float32", quantize="none"))
    message = str(raised.value)
    assert message.startswith(
        f"{huge} needs about 1408.5 GB (1280.0 GB of weights, 0.0 GB of KV window at 2,000 tokens, "
        "128.5 GB for torch and activations) but about "
    )
    assert message.endswith(
        " GB of memory is available; close other programs, pick a smaller model or --quantize int4, or shrink --window"
    )
    assert raised.value.exit_code == 6


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_an_unavailable_device_fails_before_any_download():
    with pytest.raises(ConfigError, match="--device cuda: torch sees no CUDA GPU here"):
        load_model(LoadOptions(model="owner/not-downloaded", device="cuda"))
