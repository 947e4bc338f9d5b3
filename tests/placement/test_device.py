import pytest

from streamchat.errors import ConfigError
from streamchat.placement.device import (
    AVX512,
    Accelerators,
    Placement,
    available_devices,
    choose_device,
    choose_dtype,
    chosen_variant,
    cpu_bf16_from_cpuinfo,
    for_quantization,
    is_device_name,
    is_dtype_name,
    plan_placement,
)

CPU_ONLY = Accelerators()
AMPERE = Accelerators(cuda_devices=1, cuda_bf16=True)
TWO_TURINGS = Accelerators(cuda_devices=2, cuda_bf16=False)
APPLE = Accelerators(mps=True)
BF16_CPU = Accelerators(cpu_bf16=True)


@pytest.mark.parametrize(
    ("accelerators", "device"),
    [(CPU_ONLY, "cpu"), (AMPERE, "cuda"), (APPLE, "mps"), (Accelerators(1, True, True), "cuda")],
)
def test_auto_prefers_cuda_then_mps_then_cpu(accelerators: Accelerators, device: str):
    assert choose_device("auto", accelerators) == device


@pytest.mark.parametrize(
    ("accelerators", "dtype"),
    [
        (CPU_ONLY, "float32"),
        (BF16_CPU, "bfloat16"),
        (AMPERE, "bfloat16"),
        (TWO_TURINGS, "float16"),
        (APPLE, "float16"),
        (Accelerators(cuda_devices=1, cuda_bf16=False, cpu_bf16=True), "float16"),
    ],
)
def test_auto_dtype_follows_the_chosen_device(accelerators: Accelerators, dtype: str):
    device = choose_device("auto", accelerators)
    assert choose_dtype("auto", device, accelerators) == dtype


def test_an_explicit_dtype_wins_everywhere():
    assert choose_dtype("bfloat16", "cpu", CPU_ONLY) == "bfloat16"
    assert choose_dtype("float32", "cuda", AMPERE) == "float32"


def test_an_explicit_device_is_used_when_present():
    assert choose_device("cpu", AMPERE) == "cpu"
    assert choose_device("cuda", AMPERE) == "cuda"
    assert choose_device("mps", APPLE) == "mps"


@pytest.mark.parametrize(
    ("device", "message"),
    [
        ("cuda", "--device cuda: torch sees no CUDA GPU here; use --device auto or --device cpu"),
        ("mps", "--device mps: Apple's Metal backend is not available here; use --device auto or cpu"),
        ("tpu", "--device 'tpu' is not a device; choose one of auto, cpu, cuda, mps, or cuda:N"),
        ("cuda:1", "--device cuda:1: no such GPU here (available: cpu); use one of those or --device auto"),
    ],
)
def test_an_unavailable_device_is_a_config_error(device: str, message: str):
    with pytest.raises(ConfigError) as raised:
        choose_device(device, CPU_ONLY)
    assert str(raised.value) == message
    assert raised.value.exit_code == 2


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "mps", "cuda:0", "cuda:12"])
def test_device_names_include_one_gpu_by_index(name: str):
    assert is_device_name(name)


@pytest.mark.parametrize("name", ["gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1:0", "cuda:x", "mps:0", "cpu:0", ""])
def test_other_device_names_are_refused(name: str):
    assert not is_device_name(name)


def test_dtype_names_are_the_four_choices():
    assert [name for name in ("auto", "float32", "bfloat16", "float16", "fp16", "float64") if is_dtype_name(name)] == [
        "auto",
        "float32",
        "bfloat16",
        "float16",
    ]


def test_one_gpu_by_index_is_used_when_present():
    assert choose_device("cuda:0", AMPERE) == "cuda:0"
    assert choose_device("cuda:1", TWO_TURINGS) == "cuda:1"
    assert plan_placement("cuda:1", "auto", None, TWO_TURINGS) == Placement("cuda:1", "float16", device_map="cuda:1")
    assert plan_placement("cuda:0", "auto", None, AMPERE) == Placement("cuda:0", "bfloat16", device_map="cuda:0")


@pytest.mark.parametrize(
    ("accelerators", "available"),
    [
        (CPU_ONLY, "cpu"),
        (AMPERE, "cpu, cuda:0"),
        (TWO_TURINGS, "cpu, cuda:0, cuda:1"),
        (Accelerators(mps=True), "cpu, mps"),
    ],
)
def test_a_missing_gpu_index_names_the_devices_that_exist(accelerators: Accelerators, available: str):
    assert ", ".join(available_devices(accelerators)) == available
    with pytest.raises(ConfigError) as raised:
        choose_device("cuda:2", accelerators)
    assert str(raised.value) == (
        f"--device cuda:2: no such GPU here (available: {available}); use one of those or --device auto"
    )
    assert raised.value.exit_code == 2


def test_an_unknown_dtype_is_a_config_error():
    with pytest.raises(
        ConfigError, match="--dtype 'float8' is not a dtype; choose one of auto, float32, bfloat16, float16"
    ):
        choose_dtype("float8", "cpu", CPU_ONLY)


def test_without_a_device_map_the_model_goes_to_one_device():
    assert plan_placement("auto", "auto", None, AMPERE) == Placement("cuda", "bfloat16", device_map="cuda")
    assert plan_placement("cpu", "bfloat16", None, AMPERE) == Placement("cpu", "bfloat16", device_map="cpu")


def test_device_map_auto_spreads_over_the_gpus():
    assert plan_placement("auto", "auto", "auto", TWO_TURINGS) == Placement("cuda", "float16", device_map="auto")
    assert plan_placement("cuda", "float32", "auto", AMPERE) == Placement("cuda", "float32", device_map="auto")


@pytest.mark.parametrize(
    ("device", "device_map", "accelerators", "message"),
    [
        (
            "auto",
            "auto",
            CPU_ONLY,
            "--device-map auto needs CUDA GPUs, and torch sees none here; leave it out",
        ),
        (
            "cpu",
            "auto",
            AMPERE,
            "--device-map auto spreads the model over CUDA GPUs; drop it or --device cpu",
        ),
        (
            "auto",
            "balanced",
            AMPERE,
            "--device-map 'balanced' is not supported; use --device-map auto or leave it out",
        ),
        (
            "cuda:1",
            "auto",
            TWO_TURINGS,
            "--device-map auto spreads the model over CUDA GPUs; drop it or --device cuda:1",
        ),
        (
            "gpu",
            "auto",
            TWO_TURINGS,
            "--device 'gpu' is not a device; choose one of auto, cpu, cuda, mps, or cuda:N",
        ),
    ],
)
def test_impossible_device_maps_are_config_errors(
    device: str, device_map: str, accelerators: Accelerators, message: str
):
    with pytest.raises(ConfigError) as raised:
        plan_placement(device, "auto", device_map, accelerators)
    assert str(raised.value) == message


def test_an_explicit_dtype_wins_on_a_bf16_cpu():
    assert choose_dtype("float32", "cpu", BF16_CPU) == "float32"
    assert plan_placement("cpu", "auto", None, BF16_CPU) == Placement("cpu", "bfloat16", device_map="cpu")


def x86_cpuinfo(*flag_lists: str) -> str:
    """/proc/cpuinfo as x86 Linux writes it, one block per processor."""
    blocks = [
        f"processor\t: {index}\nmodel name\t: Some CPU\nflags\t\t: {flags}\nvmx flags\t: bf16 avx512_bf16\n"
        for index, flags in enumerate(flag_lists)
    ]
    return "\n".join(blocks)


ZEN4 = "fpu sse2 avx2 avx512f avx512bw avx512_vnni avx512_bf16"
SAPPHIRE_RAPIDS = "fpu sse2 avx2 avx512f avx512bw amx_tile amx_bf16 amx_int8"
SKYLAKE = "fpu sse2 avx2 avx512f avx512bw avx512_vnni"


@pytest.mark.parametrize(
    ("cpuinfo", "native"),
    [
        (x86_cpuinfo(ZEN4, ZEN4), True),
        (x86_cpuinfo(SAPPHIRE_RAPIDS), True),
        (x86_cpuinfo(SKYLAKE, SKYLAKE), False),  # AVX-512 alone: torch converts bf16 to float32
        (x86_cpuinfo(ZEN4, SKYLAKE), False),  # every core must have it
        ("processor\t: 0\nvendor_id\t: GenuineIntel\n", False),  # no flags line: no claim
        ("", False),
    ],
)
def test_x86_bf16_comes_from_the_cpuinfo_flags(cpuinfo: str, native: bool):
    assert cpu_bf16_from_cpuinfo(cpuinfo, "x86_64") is native


GRAVITON_3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 svebf16 i8mm\nCPU implementer\t: 0x41\n"
GRAVITON_2 = "processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU implementer\t: 0x41\n"


@pytest.mark.parametrize(("cpuinfo", "native"), [(GRAVITON_3, True), (GRAVITON_2, False)])
def test_aarch64_bf16_comes_from_the_cpuinfo_features(cpuinfo: str, native: bool):
    assert cpu_bf16_from_cpuinfo(cpuinfo, "aarch64") is native


def test_flags_are_read_only_for_the_architecture_that_writes_them():
    # An x86 flags line read on an unknown architecture proves nothing.
    assert not cpu_bf16_from_cpuinfo(x86_cpuinfo(ZEN4), "riscv64")
    assert not cpu_bf16_from_cpuinfo(GRAVITON_3, "x86_64")


@pytest.mark.parametrize(
    ("quantize", "dtype"), [("auto", "bfloat16"), ("int4", "bfloat16"), ("int8", "bfloat16"), ("none", "float32")]
)
def test_bfloat16_for_the_kernels_only_where_they_run_the_layers(quantize, dtype):
    # streamchat's kernels run quantized layers: unquantized (and --tp's none), a CPU without bf16 keeps float32.
    kernels_cpu = Accelerators(cpu_kernels=True)
    assert choose_dtype("auto", "cpu", for_quantization(kernels_cpu, quantize)) == dtype
    assert choose_dtype("auto", "cpu", for_quantization(BF16_CPU, quantize)) == "bfloat16"  # native bf16: always


AVX512_CPU = AVX512.cpu_flags | {"avx2", "sse4_2"}
AVX2_CPU = frozenset({"avx", "avx2", "fma", "f16c", "sse4_2"})


@pytest.mark.parametrize(
    ("asked", "flags", "chosen"),
    [
        ("", AVX512_CPU, "avx512"),  # the best this CPU runs
        ("", AVX2_CPU, "avx2"),
        ("", frozenset({"avx", "sse4_2"}), None),  # no FMA, no AVX2: none
        ("avx2", AVX512_CPU, "avx2"),  # named: forced where the CPU runs it
        (" AVX2 ", AVX512_CPU, "avx2"),
        ("avx512", AVX2_CPU, None),  # named, but not run here
        ("0", AVX512_CPU, None),
        ("1", AVX2_CPU, "avx2"),  # any other value: the best
    ],
)
def test_the_variant_is_the_best_the_cpu_runs_unless_the_environment_names_one(asked, flags, chosen):
    variant = chosen_variant(asked, flags)
    assert (variant.name if variant else None) == chosen
