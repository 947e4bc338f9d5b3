"""Where the model runs and in what precision.

The choices are pure functions of what the machine offers (an Accelerators value), so
every rule is testable without a GPU or a particular CPU; only detect_accelerators()
asks torch and the operating system. Among what a CPU offers: which build (Variant) of
streamchat's own kernels it runs, read from its flags, and a C compiler to build it
(placement/native.py builds, binds and checks them).
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path

from streamchat import defaults
from streamchat.errors import ConfigError

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
    # (major, minor) compute capability of the oldest GPU; (0, 0) without one.
    cuda_capability: tuple[int, int] = (0, 0)
    mps: bool = False
    # The CPU computes bfloat16 dot products in hardware (see detect_cpu_bf16).
    cpu_bf16: bool = False
    # streamchat's own CPU kernels run here (native_kernels_run_here: AVX2 or AVX-512, a C compiler).
    cpu_kernels: bool = False


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
        cuda_capability=min((torch.cuda.get_device_capability(index) for index in range(cuda_devices)), default=(0, 0)),
        mps=torch.backends.mps.is_available(),
        cpu_bf16=detect_cpu_bf16(),
        cpu_kernels=native_kernels_run_here(),
    )


# /proc/cpuinfo flags that mean native bf16 dot products: AVX512_BF16 (Cooper Lake, Zen 4
# and later) or AMX (Sapphire Rapids and later) on x86; the BF16 extension (ARMv8.6:
# Graviton 3, Neoverse V1/V2) on aarch64, which lists it under "Features".
X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
ARM_BF16_FLAGS = ("bf16",)
# macOS answers this sysctl with 1 on Apple M2 and later.
MACOS_BF16_SYSCTL = "hw.optional.arm.FEAT_BF16"


def detect_cpu_bf16() -> bool:
    """Whether this CPU says it has native bf16, read from the operating system; False when it cannot tell."""
    system, machine = platform.system(), platform.machine().lower()
    if system == "Linux":
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
        except OSError:
            return False
        return cpu_bf16_from_cpuinfo(cpuinfo, machine)
    if system == "Darwin" and machine == "arm64":
        return _sysctl(MACOS_BF16_SYSCTL) == "1"
    return False  # Windows and the rest: no flag read here, so no claim


def cpu_bf16_from_cpuinfo(cpuinfo: str, machine: str) -> bool:
    """Whether Linux's /proc/cpuinfo text lists a native bf16 flag for `machine` (platform.machine(), lowercase).

    Each processor's block lists its flags ("flags" on x86, "Features" on aarch64); all
    processors must have one, since a thread may run on any of them.
    """
    wanted: tuple[str, ...]
    if machine in ("x86_64", "amd64", "i686", "i386"):
        key, wanted = "flags", X86_BF16_FLAGS
    elif machine in ("aarch64", "arm64"):
        key, wanted = "features", ARM_BF16_FLAGS
    else:
        return False
    flag_lines = [
        line.partition(":")[2].split() for line in cpuinfo.splitlines() if line.partition(":")[0].strip().lower() == key
    ]
    return bool(flag_lines) and all(any(flag in flags for flag in wanted) for flags in flag_lines)


def _sysctl(name: str) -> str | None:
    try:
        answer = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return answer.stdout.strip() if answer.returncode == 0 else None


# ---- streamchat's own CPU kernels (placement/native.py): which build of them this CPU runs -------------


@dataclass(frozen=True)
class Variant:
    """One build of the kernels: the instructions it is compiled for, and the CPU flags (as /proc/cpuinfo
    names them) that must all be there to run it."""

    name: str
    compiler_flags: tuple[str, ...]
    cpu_flags: frozenset[str]


AVX512 = Variant(
    "avx512",
    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mfma", "-mf16c"),
    frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"}),
)
AVX2 = Variant("avx2", ("-mavx2", "-mfma", "-mf16c"), frozenset({"avx2", "fma", "f16c"}))
VARIANTS = (AVX512, AVX2)  # the best first: what a CPU gets unless the environment names one
NO_KERNELS = "0"  # STREAMCHAT_NATIVE_KERNELS=0: torch's kernels only


def chosen_variant(asked: str, flags: frozenset[str]) -> Variant | None:
    """The variant STREAMCHAT_NATIVE_KERNELS names (`asked`: "0" for none, "" or any other value for the
    best) if a CPU with `flags` runs it, else None."""
    if asked == NO_KERNELS:
        return None
    named = [variant for variant in VARIANTS if variant.name == asked.strip().lower()]
    return next((variant for variant in named or VARIANTS if variant.cpu_flags <= flags), None)


def native_kernels_run_here() -> bool:
    """Whether placement/native.py's load_native_kernels can be expected to give kernels here: a variant this CPU
    runs (and the environment allows), and a C compiler to build it. Nothing is built."""
    return chosen_variant(kernels_asked(None), cpu_flags()) is not None and c_compiler() is not None


def kernels_asked(asked: str | None) -> str:
    """The variant `asked` for, else the one STREAMCHAT_NATIVE_KERNELS names ("" when it names none)."""
    return os.environ.get(defaults.NATIVE_KERNELS_ENV, "") if asked is None else asked


def cpu_flags() -> frozenset[str]:
    """The instruction set flags every processor of this machine lists; none where the kernels cannot run
    (not Linux on x86-64) or the flags cannot be read."""
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return frozenset()
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    lines = [line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")]
    return frozenset.intersection(*map(frozenset, lines)) if lines else frozenset()


def c_compiler() -> str | None:
    """$CC if it names a program that is there, else cc or gcc; None without one."""
    named = os.environ.get("CC")
    return shutil.which(named) if named else shutil.which("cc") or shutil.which("gcc")


def for_quantization(accelerators: Accelerators, quantize: str) -> Accelerators:
    """`accelerators` as choose_dtype should see them for `--quantize quantize` (after --tp's own rule):
    streamchat's kernels run quantized layers' products only, so a model left unquantized gains nothing from
    bfloat16 storage on a CPU without bf16, where torch would emulate its products."""
    return accelerators if quantize in ("auto", "int4", "int8") else replace(accelerators, cpu_kernels=False)


def plan_placement(device: str, dtype: str, device_map: str | None, accelerators: Accelerators) -> Placement:
    """Check --device, --dtype and --device-map together and settle every "auto"."""
    _check_device_name(device)
    if device_map is None:
        chosen = choose_device(device, accelerators)
        return Placement(chosen, choose_dtype(dtype, chosen, accelerators), device_map=chosen)
    if device_map not in defaults.DEVICE_MAPS:
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
    """`requested`, or for "auto": bfloat16 on GPUs and on CPUs that have it natively or run streamchat's
    kernels, float16 on other GPUs and on Apple's MPS, float32 on other CPUs.

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
    # Without bf16 in hardware torch emulates it by converting operands to float32 and back,
    # which is not known to beat float32 and rounds more: keep float32 there, unless
    # streamchat's kernels run the decode (they compute in float32 from bfloat16 and int4
    # storage): on an AVX2 CPU they decode the default model 5x faster than float32.
    return "bfloat16" if accelerators.cpu_bf16 or accelerators.cpu_kernels else "float32"
