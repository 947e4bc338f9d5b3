import pytest

from streamchat.errors import ConfigError
from streamchat.loading.device import Accelerators, Placement, choose_device, choose_dtype, plan_placement

CPU_ONLY = Accelerators()
AMPERE = Accelerators(cuda_devices=1, cuda_bf16=True)
TWO_TURINGS = Accelerators(cuda_devices=2, cuda_bf16=False)
APPLE = Accelerators(mps=True)


@pytest.mark.parametrize(
    ("accelerators", "device"),
    [(CPU_ONLY, "cpu"), (AMPERE, "cuda"), (APPLE, "mps"), (Accelerators(1, True, True), "cuda")],
)
def test_auto_prefers_cuda_then_mps_then_cpu(accelerators: Accelerators, device: str):
    assert choose_device("auto", accelerators) == device


@pytest.mark.parametrize(
    ("accelerators", "dtype"),
    [(CPU_ONLY, "float32"), (AMPERE, "bfloat16"), (TWO_TURINGS, "float16"), (APPLE, "float16")],
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
        ("tpu", "--device 'tpu' is not a device; choose one of auto, cpu, cuda, mps"),
    ],
)
def test_an_unavailable_device_is_a_config_error(device: str, message: str):
    with pytest.raises(ConfigError) as raised:
        choose_device(device, CPU_ONLY)
    assert str(raised.value) == message
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
    ],
)
def test_impossible_device_maps_are_config_errors(
    device: str, device_map: str, accelerators: Accelerators, message: str
):
    with pytest.raises(ConfigError) as raised:
        plan_placement(device, "auto", device_map, accelerators)
    assert str(raised.value) == message
