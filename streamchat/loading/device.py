"""Where the model runs and in what precision.

The choices are pure functions of what the machine offers (an Accelerators value), so
every rule is testable without a GPU; only detect_accelerators() asks torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from streamchat import defaults
from streamchat.errors import ConfigError

DEVICE_MAPS = ("auto",)
# How messages list the accepted --device and --dtype values.
DEVICE_NAMES = f"{', '.join(defaults.DEVICES)}, or cuda:N"
DTYPE_NAMES = ", ".join(defaults.DTYPES)

# One GPU by its index, as torch spells it.
_CUDA_INDEX = re.compile(r"cuda:(\d+)")


@dataclass(frozen=True)
class Accelerators:
    """What torch can use on this machine."""

    cuda_devices: int = 0
    cuda_bf16: bool = False
    mps: bool = False


@dataclass(frozen=True)
class Placement:
    """Where and how to load the weights."""

    # "cpu", "cuda", "cuda:N" or "mps"; with device_map "auto", "cuda" (the model spans the GPUs).
    device: str
    # "float32", "bfloat16" or "float16".
    dtype: str
    # What from_pretrained gets: the device itself, or "auto" to let accelerate spread the layers.
    device_map: str


def is_device_name(name: str) -> bool:
    """Whether `name` spells a --device value (see DEVICE_NAMES), whether or not this machine has it."""
    return name in defaults.DEVICES or _CUDA_INDEX.fullmatch(name) is not None


def is_dtype_name(name: str) -> bool:
    """Whether `name` spells a --dtype value (see DTYPE_NAMES)."""
    return name in defaults.DTYPES


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
    _check_device_name(device)
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
    _check_device_name(requested)
    if requested == "auto":
        if accelerators.cuda_devices:
            return "cuda"
        return "mps" if accelerators.mps else "cpu"
    if requested == "cuda" and not accelerators.cuda_devices:
        raise ConfigError("--device cuda: torch sees no CUDA GPU here; use --device auto or --device cpu")
    if requested == "mps" and not accelerators.mps:
        raise ConfigError("--device mps: Apple's Metal backend is not available here; use --device auto or cpu")
    index = _CUDA_INDEX.fullmatch(requested)
    if index is not None and int(index.group(1)) >= accelerators.cuda_devices:
        raise ConfigError(
            f"--device {requested}: no such GPU here (available: {', '.join(available_devices(accelerators))}); "
            "use one of those or --device auto"
        )
    return requested


def _check_device_name(requested: str) -> None:
    if not is_device_name(requested):
        raise ConfigError(f"--device {requested!r} is not a device; choose one of {DEVICE_NAMES}")


def available_devices(accelerators: Accelerators) -> list[str]:
    """The devices this machine offers, each as --device spells it."""
    gpus = [f"cuda:{index}" for index in range(accelerators.cuda_devices)]
    return ["cpu", *gpus, *(["mps"] if accelerators.mps else [])]


def choose_dtype(requested: str, device: str, accelerators: Accelerators) -> str:
    """`requested`, or for "auto": bfloat16 on GPUs that support it, float16 on other GPUs, float32 on CPU.

    `device` is a device choose_device returned.
    """
    if requested != "auto":
        if not is_dtype_name(requested):
            raise ConfigError(f"--dtype {requested!r} is not a dtype; choose one of {DTYPE_NAMES}")
        return requested
    if device.split(":")[0] == "cuda":  # "cuda" or one GPU, "cuda:N"
        return "bfloat16" if accelerators.cuda_bf16 else "float16"
    if device == "mps":
        return "float16"
    return "float32"
