import pytest
import torch

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.placement.device import Accelerators
from streamchat.placement.int4_linear import Int4Linear
from streamchat.placement.int8_linear import BlockInt8Embedding, Int8Linear
from streamchat.placement.quantization import (
    QuantizationPlan,
    plan_kv_cache,
    plan_quantization,
    precision_label,
    quantize_model,
)
from tests.support.models import tiny_config, tiny_model

CPU_ONLY = Accelerators()
HOPPER = Accelerators(cuda_devices=1, cuda_bf16=True, cuda_capability=(9, 0))
TURING = Accelerators(cuda_devices=1, cuda_bf16=False, cuda_capability=(7, 5))

CPU_INT4 = QuantizationPlan("int4", layers="int4-aten", head="int8-aten")
CPU_INT8 = QuantizationPlan("int8", layers="int8-aten", head="int8-aten")


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "accelerators", "plan"),
    [
        ("auto", "cpu", "bfloat16", CPU_ONLY, CPU_INT4),
        ("auto", "cpu", "float32", CPU_ONLY, QuantizationPlan("none")),  # the kernels' float32 paths are slow
        ("auto", "cuda", "bfloat16", HOPPER, QuantizationPlan("none")),
        ("auto", "mps", "float16", Accelerators(mps=True), QuantizationPlan("none")),
        ("none", "cpu", "bfloat16", CPU_ONLY, QuantizationPlan("none")),
        ("int8", "cpu", "float32", CPU_ONLY, CPU_INT8),
        ("int4", "cpu", "float16", CPU_ONLY, CPU_INT4),
        ("int8", "cuda:0", "float16", HOPPER, QuantizationPlan("int8", layers="int8-torchao")),
        ("int4", "cuda", "bfloat16", HOPPER, QuantizationPlan("int4", layers="int4-torchao-cuda")),
        ("int8", "cuda", "float16", TURING, QuantizationPlan("int8", layers="int8-torchao")),
    ],
)
def test_each_device_gets_its_scheme(requested, device, dtype, accelerators, plan):
    assert plan_quantization(requested, device, dtype, accelerators) == plan


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "accelerators", "plan"),
    [
        ("auto", "cpu", "bfloat16", Accelerators(cpu_kernels=True), CPU_INT8),  # the file's blocks, as they are
        ("auto", "cpu", "bfloat16", CPU_ONLY, CPU_INT4),  # aten's int8 has a scale per row: no gain in precision
        ("auto", "cpu", "float32", Accelerators(cpu_kernels=True), QuantizationPlan("none")),
        ("int4", "cpu", "bfloat16", Accelerators(cpu_kernels=True), CPU_INT4),  # asked for less
        ("auto", "cuda", "bfloat16", HOPPER, QuantizationPlan("none")),
    ],
)
def test_auto_keeps_a_q8_0_files_blocks_where_the_kernels_take_them(requested, device, dtype, accelerators, plan):
    assert plan_quantization(requested, device, dtype, accelerators, source_blocks=True) == plan


@pytest.mark.parametrize(
    ("requested", "device", "dtype", "accelerators", "message"),
    [
        (
            "int4",
            "cuda",
            "float16",
            HOPPER,
            "--quantize int4 on CUDA computes in bfloat16 only, not float16; "
            "add --dtype bfloat16 or use --quantize int8",
        ),
        (
            "int4",
            "cuda",
            "bfloat16",
            TURING,
            "--quantize int4 on CUDA needs compute capability 8.0 or newer (Ampere), this GPU has 7.5; "
            "use --quantize int8 or none",
        ),
        (
            "int8",
            "mps",
            "float16",
            Accelerators(mps=True),
            "--quantize int8 is not supported on mps; use --quantize none or --device cpu",
        ),
        (
            "int3",
            "cpu",
            "float32",
            CPU_ONLY,
            "--quantize 'int3' is not a quantization; choose one of auto, none, int8, int4",
        ),
    ],
)
def test_impossible_combinations_are_one_line_config_errors(requested, device, dtype, accelerators, message):
    with pytest.raises(ConfigError) as raised:
        plan_quantization(requested, device, dtype, accelerators)
    assert str(raised.value) == message
    assert raised.value.exit_code == 2


def fresh_tiny(dtype=torch.float32, **overrides):
    """An unshared tiny llama (tiny_model's are cached and read-only) whose k and v are as wide as q, so that
    every projection is whole int4 blocks on any CPU (64 outputs: aten packs 64 at a time on AVX-512)."""
    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", **{"num_key_value_heads": 4, **overrides})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(dtype).eval()


def last_logits(model, ids):
    with torch.inference_mode():
        return model(ids).logits[0, -1].float()


IDS = torch.tensor([[5, 17, 99, 3, 42, 7, 200, 11]])


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cpu_models_predict_as_the_float_model_does(method, dtype):
    model = fresh_tiny(dtype)
    expected = last_logits(model, IDS)
    quantized = quantize_model(model, plan_quantization(method, "cpu", str(dtype).removeprefix("torch."), CPU_ONLY))
    got = last_logits(model, IDS)
    assert quantized == 2 * 7 + 2  # two layers of q, k, v, o, gate, up, down, the head and the input embedding
    assert not torch.equal(got, expected)  # the weights really changed
    # Random Gaussian weights are the worst case for 4 bits (trained ones, and Q4_1 ones, fare better).
    tolerance = {"int8": 0.02, "int4": 0.1}[method]
    assert (got - expected).abs().max() <= tolerance * expected.abs().max()


def test_int4_on_cpu_packs_the_layers_keeps_the_head_in_int8_and_the_embedding_in_int8_blocks():
    model = fresh_tiny(torch.bfloat16)
    table = model.get_input_embeddings().weight.detach().clone()
    quantize_model(model, plan_quantization("int4", "cpu", "bfloat16", CPU_ONLY))
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, Int4Linear)
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    assert isinstance(model.get_output_embeddings(), Int8Linear)
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, BlockInt8Embedding) and embedding.weight.dtype == torch.int8
    rows = embedding(IDS)
    assert rows.dtype == torch.bfloat16
    # Within half a step of each block of 32 (its largest magnitude over 127), and the bfloat16 rounding after.
    blocks = table[IDS].float().reshape(1, 8, 2, 32)
    step = blocks.abs().amax(dim=-1, keepdim=True) / 127
    assert ((rows.float().reshape(1, 8, 2, 32) - blocks).abs() <= step / 2 + blocks.abs() / 128).all()


def test_int8_on_cpu_replaces_every_linear_layer():
    model = fresh_tiny(torch.bfloat16)
    quantize_model(model, plan_quantization("int8", "cpu", "bfloat16", CPU_ONLY))
    assert not [name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_layers_the_kernels_cannot_take_stay_as_they_were(method):
    # 56 inputs: neither a multiple of the int8 kernel's 16 nor of int4's group of 32.
    model = fresh_tiny(torch.bfloat16, hidden_size=56, head_dim=16)
    quantize_model(model, plan_quantization(method, "cpu", "bfloat16", CPU_ONLY))
    mlp = model.model.layers[0].mlp
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert type(mlp.up_proj.weight) is torch.nn.Parameter
    # down_proj reads the 128-wide MLP: int8 takes it; int4 does not (56 outputs, not whole blocks of 32).
    assert isinstance(mlp.down_proj, Int8Linear) if method == "int8" else type(mlp.down_proj) is torch.nn.Linear


def test_none_leaves_the_model_alone():
    model = fresh_tiny()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert quantize_model(model, plan_quantization("none", "cpu", "float32", CPU_ONLY)) == 0
    assert all(torch.equal(tensor, before[name]) for name, tensor in model.state_dict().items())


@pytest.mark.parametrize(
    ("dtype", "quantization", "label"),
    [
        (torch.bfloat16, "int8", "bfloat16 int8"),
        (torch.float16, "int4", "float16 int4"),
        (torch.float32, "none", "float32"),
    ],
)
def test_the_precision_label_names_the_dtype_and_any_quantization(dtype, quantization, label):
    assert precision_label(dtype, quantization) == label


def test_tiny_models_stay_cached_unchanged():
    # quantize_model works in place: the tests quantize their own copies, never tiny_model's.
    assert type(tiny_model("llama").model.layers[0].self_attn.q_proj) is torch.nn.Linear


@pytest.mark.cuda
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_cuda_models_predict_as_the_float_model_does(method):
    from streamchat.placement.device import detect_accelerators

    model = fresh_tiny(torch.bfloat16).to("cuda")
    ids = IDS.to("cuda")
    expected = last_logits(model, ids)
    quantize_model(model, plan_quantization(method, "cuda", "bfloat16", detect_accelerators()))
    got = last_logits(model, ids)
    assert not torch.equal(got, expected)
    assert torch.allclose(got, expected, atol=0.05 * expected.abs().max().item())


@pytest.mark.parametrize(
    ("requested", "native_kernels", "settled"),
    [
        ("full", True, "full"),
        ("int8", False, "int8"),  # asked for: an int8 window, read widened where no kernel reads it as stored
        ("auto", True, defaults.AUTO_KV_CACHE_NATIVE),
        ("auto", False, defaults.AUTO_KV_CACHE),
    ],
)
def test_the_kv_cache_settles_auto_by_whether_the_native_kernels_run(requested, native_kernels, settled):
    assert plan_kv_cache(requested, native_kernels) == settled


def test_an_unknown_kv_cache_is_a_one_line_config_error():
    with pytest.raises(ConfigError, match="--kv-cache 'q8' is not a KV cache format; choose one of auto, full, int8"):
        plan_kv_cache("q8", native_kernels=True)
