from pathlib import Path
from typing import cast

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config

from streamchat.errors import ConfigError, OutOfMemoryError
from streamchat.placement.device import Accelerators
from streamchat.placement.fusion import fuse_projections
from streamchat.placement.native import NativeKernels
from streamchat.placement.native_layers import TiledInt8Head
from streamchat.placement.quantization import plan_quantization, quantize_model
from streamchat.weights.footprint import (
    Footprint,
    available_device_memory,
    available_memory,
    ensure_fits,
    kv_window_bytes,
    model_footprint,
    required_bytes,
    weight_bytes,
)
from tests.support.models import tiny_config

# The tiny llama (tests/support/models.py): hidden 64, intermediate 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 256.
# Its linear layers, weights per layer: q 64x64, k 32x64, v 32x64, o 64x64, gate and up 128x64, down 64x128.
LINEAR_WEIGHTS = 2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 128 * 64 + 128 * 64 + 64 * 128)
LINEAR_ROWS = 2 * (64 + 32 + 32 + 64 + 128 + 128 + 64)  # one int8 scale each
TABLE = 256 * 64  # the input embedding, and the output head as large
NORMS = 2 * 2 * 64 + 64  # two per layer and the final one
EMBEDDING = TABLE + TABLE // 32 * 2  # a quantized model's input embedding: int8, a float16 scale per 32

# bfloat16: half a byte a weight and two float16 params per group of 32 of a row in int4 (a byte a weight and a
# float16 scale per block of 32 in int8); the head in int8, with a float32 scale and an int32 sum per row; the
# input embedding in int8 blocks; the norms in bfloat16.
INT4_BF16 = LINEAR_WEIGHTS // 2 + LINEAR_WEIGHTS // 32 * 4 + (TABLE + 256 * 8) + EMBEDDING + NORMS * 2
INT8_BF16 = LINEAR_WEIGHTS + LINEAR_WEIGHTS // 32 * 2 + (TABLE + 256 * 8) + EMBEDDING + NORMS * 2


def test_the_figures_are_counted_by_hand():
    assert (LINEAR_WEIGHTS, LINEAR_ROWS, INT4_BF16, INT8_BF16) == (73_728, 1024, 82_560, 114_816)


@pytest.mark.parametrize(
    ("tied", "dtype", "quantization", "expected"),
    [
        (False, "bfloat16", "int4", INT4_BF16),
        (True, "bfloat16", "int4", INT4_BF16),  # quantizing unties the head: an int8 copy beside the embedding
        (False, "bfloat16", "int8", INT8_BF16),
        (True, "bfloat16", "int8", INT8_BF16),
        (False, "bfloat16", "none", (LINEAR_WEIGHTS + 2 * TABLE + NORMS) * 2),
        (True, "bfloat16", "none", (LINEAR_WEIGHTS + TABLE + NORMS) * 2),  # one table for both ends
        (False, "float32", "none", (LINEAR_WEIGHTS + 2 * TABLE + NORMS) * 4),
        # float32 int4: the packed layers and the embedding are the same, the norms twice as large.
        (False, "float32", "int4", INT4_BF16 + NORMS * 2),
        (False, "float16", "int8", INT8_BF16),
    ],
)
def test_the_weights_of_a_tiny_llama(tied: bool, dtype: str, quantization: str, expected: int):
    assert weight_bytes(tiny_config("llama", tie_word_embeddings=tied), dtype, quantization) == expected


def test_atens_int4_layers_keep_their_pairs_in_dtype_and_its_head_its_scales():
    # Int4Linear: a (step, zero) pair in the model's dtype per group of a row; Int8Head: a scale in dtype per row.
    float32 = LINEAR_WEIGHTS // 2 + LINEAR_WEIGHTS // 32 * 8 + (TABLE + 256 * 4) + EMBEDDING + NORMS * 4
    assert weight_bytes(tiny_config("llama"), "float32", "int4", native=False) == float32
    bfloat16 = INT4_BF16 - 256 * 8 + 256 * 2
    assert weight_bytes(tiny_config("llama"), "bfloat16", "int4", native=False) == bfloat16


def test_atens_int8_layers_keep_a_scale_in_dtype_per_row():
    # Int8Linear and Int8Head where streamchat's kernels do not run: a byte a weight and a bfloat16 scale per row.
    rows = LINEAR_WEIGHTS + LINEAR_ROWS * 2 + (TABLE + 256 * 2) + EMBEDDING + NORMS * 2
    assert weight_bytes(tiny_config("llama"), "bfloat16", "int8", native=False) == rows


def test_the_config_is_left_as_it_was():
    config = tiny_config("llama")
    weight_bytes(config, "bfloat16", "int4")
    assert config.to_dict() == tiny_config("llama").to_dict()


def test_a_layer_the_kernels_cannot_take_stays_in_its_dtype():
    # Intermediate 120: gate_up (240 rows) fits, down's 120 inputs are no whole number of groups.
    config = tiny_config("llama", intermediate_size=120)
    down = 64 * 120
    linears = 2 * (128 * 64 + 64 * 64 + 240 * 64)
    head_and_rest = (TABLE + 256 * 8) + EMBEDDING + NORMS * 2
    assert weight_bytes(config, "bfloat16", "int4") == linears * 5 // 8 + 2 * down * 2 + head_and_rest


def unique_bytes(model: torch.nn.Module) -> int:
    """The bytes of the model's tensors, a tensor held under two names (tied weights) once."""
    tensors = {(t.data_ptr(), t.numel(), t.dtype): t for t in model.state_dict().values()}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def loaded(tied: bool, dtype: torch.dtype) -> torch.nn.Module:
    """A tiny random llama as the loader leaves it before quantizing: in `dtype`, its projections fused."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", tie_word_embeddings=tied)).to(dtype)
    fuse_projections(model)
    return model


@pytest.fixture
def tiled_kernels() -> NativeKernels:
    """The kernels the tiled layers are built with: a stand-in. A layer only holds its kernels (its weights are
    packed by torch), so the bytes it holds are the same as with the real ones."""
    return cast(NativeKernels, object())


CASES = [("bfloat16", "int4"), ("float32", "int4"), ("float16", "int4"), ("bfloat16", "int8"), ("float32", "int8")]


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("dtype", "quantization"), CASES)
def test_the_figure_is_what_a_model_quantized_for_the_native_kernels_holds(
    tiled_kernels, tied: bool, dtype: str, quantization: str
):
    model = loaded(tied, getattr(torch, dtype))
    quantize_model(model, plan_quantization(quantization, "cpu", dtype, Accelerators()), tiled_kernels)
    assert isinstance(model.get_output_embeddings(), TiledInt8Head)
    assert unique_bytes(model) == weight_bytes(tiny_config("llama", tie_word_embeddings=tied), dtype, quantization)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize(("dtype", "quantization"), CASES)
def test_the_figure_is_what_a_model_quantized_for_atens_kernels_holds(tied: bool, dtype: str, quantization: str):
    model = loaded(tied, getattr(torch, dtype))
    quantize_model(model, plan_quantization(quantization, "cpu", dtype, Accelerators()))
    expected = weight_bytes(tiny_config("llama", tie_word_embeddings=tied), dtype, quantization, native=False)
    assert unique_bytes(model) == expected


@pytest.mark.parametrize("tied", [False, True])
def test_the_figure_is_what_an_unquantized_model_holds(tied: bool):
    model = loaded(tied, torch.bfloat16)
    assert unique_bytes(model) == weight_bytes(tiny_config("llama", tie_word_embeddings=tied), "bfloat16", "none")


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (tiny_config("llama"), 2 * 2 * 2 * 16 * 100 * 2),  # keys and values, layers, KV heads, head_dim 64 / 4
        (tiny_config("llama", head_dim=32), 2 * 2 * 2 * 32 * 100 * 2),  # a head_dim of its own
        (tiny_config("gpt_neox"), 2 * 2 * 4 * 16 * 100 * 2),  # no KV heads named: every head has its own
        (
            Gemma3Config(
                text_config=dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1)
                | dict(head_dim=8, intermediate_size=128, vocab_size=256)
            ),
            2 * 3 * 1 * 8 * 100 * 2,  # a multimodal model's cache is its language model's
        ),
    ],
)
def test_the_kv_window(config, expected: int):
    assert kv_window_bytes(config, 100, "bfloat16") == expected


def test_a_footprint_is_both():
    config = tiny_config("llama")
    footprint = model_footprint(config, "bfloat16", "int4", 2000)
    assert footprint == Footprint(INT4_BF16, 2 * 2 * 2 * 16 * 2000 * 2, 2000, "int4")
    assert footprint.total == INT4_BF16 + 512_000


@pytest.mark.parametrize(
    ("dtype", "quantization", "message"),
    [
        ("int8", "none", "cannot price weights in 'int8'; choose one of float32, bfloat16, float16"),
        ("bfloat16", "auto", "cannot price weights quantized as 'auto'; choose one of none, int8, int4"),
    ],
)
def test_a_name_it_does_not_know_is_refused(dtype: str, quantization: str, message: str):
    with pytest.raises(ConfigError) as raised:
        weight_bytes(tiny_config("llama"), dtype, quantization)
    assert str(raised.value) == message


# ---- memory available -------------------------------------------------------------------------


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def host(tmp_path: Path) -> dict[str, Path]:
    """A fake /proc/meminfo (3 GB available), cgroup mount and /proc/self/cgroup (in app.scope, no limits yet)."""
    paths = {"meminfo": tmp_path / "meminfo", "cgroup_mount": tmp_path / "cgroup", "own_cgroup": tmp_path / "self"}
    write(paths["meminfo"], "MemTotal:       24683784 kB\nMemFree:         1000000 kB\nMemAvailable:    3000000 kB\n")
    write(paths["own_cgroup"], "0::/user.slice/app.scope\n")
    write(paths["cgroup_mount"] / "memory.stat", "anon 5\n")  # the root has no memory.max
    for level in ("user.slice", "user.slice/app.scope"):
        write(paths["cgroup_mount"] / level / "memory.max", "max\n")
        write(paths["cgroup_mount"] / level / "memory.current", "123456789\n")
    return paths


def limit(host: dict[str, Path], level: str, most: int, current: int, inactive_file: int = 0) -> None:
    directory = host["cgroup_mount"] / level
    write(directory / "memory.max", f"{most}\n")
    write(directory / "memory.current", f"{current}\n")
    write(directory / "memory.stat", f"anon 1\nactive_file 7\ninactive_file {inactive_file}\nfile 9\n")


def test_without_limits_it_is_the_kernels_figure(host):
    assert available_memory(**host) == 3_000_000 * 1024


def test_a_limit_leaves_what_it_does_not_use(host):
    limit(host, "user.slice/app.scope", most=2_000_000_000, current=1_500_000_000)
    assert available_memory(**host) == 500_000_000


def test_page_cache_it_would_drop_first_counts_as_free(host):
    limit(host, "user.slice/app.scope", most=2_000_000_000, current=1_500_000_000, inactive_file=100_000_000)
    assert available_memory(**host) == 600_000_000


def test_an_ancestors_limit_binds_too(host):
    limit(host, "user.slice/app.scope", most=2_000_000_000, current=1_500_000_000)
    limit(host, "user.slice", most=4_000_000_000, current=3_900_000_000)
    assert available_memory(**host) == 100_000_000


def test_a_limit_above_the_host_leaves_the_hosts_figure(host):
    limit(host, "user.slice/app.scope", most=10**12, current=0)
    assert available_memory(**host) == 3_000_000 * 1024


def test_a_cgroup_over_its_limit_has_no_room(host):
    limit(host, "user.slice", most=1_000_000_000, current=1_200_000_000)
    assert available_memory(**host) == 0


def test_in_a_container_the_mounts_root_is_its_cgroup(host):
    write(host["own_cgroup"], "0::/docker/4f1e\n")  # a path the container's mount does not have
    write(host["cgroup_mount"] / "memory.max", "1000000000\n")
    write(host["cgroup_mount"] / "memory.current", "250000000\n")
    assert available_memory(**host) == 750_000_000
    host["own_cgroup"].unlink()  # no /proc/self/cgroup: the mount's root still
    assert available_memory(**host) == 750_000_000


def test_with_no_meminfo_a_limit_is_all_there_is(host):
    host["meminfo"].unlink()
    assert available_memory(**host) is None
    limit(host, "user.slice/app.scope", most=2_000_000_000, current=1_500_000_000)
    assert available_memory(**host) == 500_000_000


def test_on_this_host_some_memory_is_available():
    if not Path("/proc/meminfo").is_file():
        pytest.skip("no /proc/meminfo: not Linux")
    assert available_device_memory("cpu") > 0


@pytest.mark.parametrize("device", ["mps", "xpu:0"])
def test_other_devices_cannot_tell(device: str):
    assert available_device_memory(device) is None


def test_without_cuda_a_gpu_cannot_tell():
    if torch.cuda.is_available():
        pytest.skip("torch sees a GPU here")
    assert available_device_memory("cuda:0") is None


@pytest.mark.cuda
def test_a_gpus_free_memory():
    free = available_device_memory("cuda:0")
    assert 0 < free <= torch.cuda.get_device_properties(0).total_memory


# ---- the verdict -------------------------------------------------------------------------------

SEVEN_B_INT4 = Footprint(weights=4_652_408_832, kv_window=1_048_576_000, window_tokens=2000, quantization="int4")


def test_what_a_run_needs():
    # A tenth more for activations, and half a gigabyte for torch itself.
    assert required_bytes(Footprint(600_000_000, 400_000_000, 2000)) == 1_600_000_000
    assert required_bytes(Footprint(600_000_000, 400_000_000, 2000), headroom=1.5) == 2_000_000_000


def test_a_model_that_cannot_fit_says_so_in_one_line():
    with pytest.raises(OutOfMemoryError) as raised:
        ensure_fits("llama-2-7b-chat", SEVEN_B_INT4, 3_200_000_000)
    assert str(raised.value) == (
        "llama-2-7b-chat needs about 6.8 GB (4.7 GB of int4 weights, 1.0 GB of KV window at 2,000 tokens, "
        "1.1 GB for torch and activations) but about 3.2 GB of memory is available; close other programs, "
        "pick a smaller model, or shrink --window"
    )
    assert raised.value.exit_code == 6


def test_unquantized_weights_point_at_int4():
    footprint = Footprint(weights=13_476_831_232, kv_window=1_048_576_000, window_tokens=2000)
    with pytest.raises(OutOfMemoryError) as raised:
        ensure_fits("llama-2-7b-chat", footprint, 8_000_000_000)
    assert str(raised.value) == (
        "llama-2-7b-chat needs about 16.5 GB (13.5 GB of weights, 1.0 GB of KV window at 2,000 tokens, "
        "2.0 GB for torch and activations) but about 8.0 GB of memory is available; close other programs, "
        "pick a smaller model or --quantize int4, or shrink --window"
    )


def test_a_model_that_fits_loads():
    needed = required_bytes(SEVEN_B_INT4)
    ensure_fits("llama-2-7b-chat", SEVEN_B_INT4, needed)
    with pytest.raises(OutOfMemoryError):
        ensure_fits("llama-2-7b-chat", SEVEN_B_INT4, needed - 1)


def test_unknown_memory_is_no_reason_to_refuse():
    ensure_fits("llama-2-7b-chat", SEVEN_B_INT4, None)
