"""Where the model runs and in what precision.

The choices are pure functions of what the machine offers (an Accelerators value), so
every rule is testable without a GPU; only detect_accelerators() asks torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from streamchat import defaults
from streamchat.errors import ConfigError

DEVICE_MAPS = ("auto",)


@dataclass(frozen=True)
class Accelerators:
    """What torch can use on this machine."""

    cuda_devices: int = 0
    cuda_bf16: bool = False
    mps: bool = False


@dataclass(frozen=True)
class Placement:
    """Where and how to load the weights."""

    # "cpu", "cuda" or "mps"; with device_map "auto", "cuda" (the model spans the GPUs).
    device: str
    # "float32", "bfloat16" or "float16".
    dtype: str
    # What from_pretrained gets: the device itself, or "auto" to let accelerate spread the layers.
    device_map: str


def detect_accelerators() -> Accelerators:
    import torch

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return Accelerators(
        cuda_devices=cuda_devices,
        cuda_bf16=cuda_devices > 0 and torch.cuda.is_bf16_supported(),
        mps=torch.backends.mps.is_available(),
    )


def plan_placement(device: str, dtype: str, device_map: str | None, accelerators: Accelerators) -> Placement:
    """Check --device, --dtype and --device-map together and settle every "auto"."""
    if device_map is None:
        chosen = choose_device(device, accelerators)
        return Placement(chosen, choose_dtype(dtype, chosen, accelerators), device_map=chosen)
    if device_map not in DEVICE_MAPS:
        raise ConfigError(f"--device-map {device_map!r} is not supported; use --device-map auto or leave it out")
    if device not in ("auto", "cuda"):
        raise ConfigError(f"--device-map auto spreads the model over CUDA GPUs; drop it or --device {device}")
    if accelerators.cuda_devices == 0:
        raise ConfigError("--device-map auto needs CUDA GPUs, and torch sees none here; leave it out")
    return Placement("cuda", choose_dtype(dtype, "cuda", accelerators), device_map="auto")


def choose_device(requested: str, accelerators: Accelerators) -> str:
    """`requested` if this machine has it; for "auto", CUDA, then Apple's MPS, then the CPU."""
    if requested == "auto":
        if accelerators.cuda_devices:
            return "cuda"
        return "mps" if accelerators.mps else "cpu"
    if requested == "cuda" and not accelerators.cuda_devices:
        raise ConfigError("--device cuda: torch sees no CUDA GPU here; use --device auto or --device cpu")
    if requested == "mps" and not accelerators.mps:
        raise ConfigError("--device mps: Apple's Metal backend is not available here; use --device auto or cpu")
    if requested not in defaults.DEVICES:
        raise ConfigError(f"--device {requested!r} is not a device; choose one of {', '.join(defaults.DEVICES)}")
    return requested


def choose_dtype(requested: str, device: str, accelerators: Accelerators) -> str:
    """`requested`, or for "auto": bfloat16 on GPUs that support it, float16 on other GPUs, float32 on CPU."""
    if requested != "auto":
        if requested not in defaults.DTYPES:
            raise ConfigError(f"--dtype {requested!r} is not a dtype; choose one of {', '.join(defaults.DTYPES)}")
        return requested
    if device == "cuda":
        return "bfloat16" if accelerators.cuda_bf16 else "float16"
    if device == "mps":
        return "float16"
    return "float32"
