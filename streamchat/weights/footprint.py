"""Whether a model fits before it loads: its weights as streamchat holds them, its KV window, the memory left.

A model too large for the machine used to end in the kernel's OOM kill halfway through a
conversion, with no word of why. This module prices a model from its config alone (built
on the meta device: no weights, no memory) and says in one line what it needs against what
is available, as an OutOfMemoryError (exit code 6), before a byte of weights is read.

    footprint = model_footprint(config, "bfloat16", "int4", window_tokens)
    ensure_fits(name, footprint, available_device_memory("cpu"))

The weights are priced in the layouts a single-process CPU load leaves them in
(loading/loader.py: fuse_projections, then quantize_model): int4 layers as TiledInt4Linear
and the int8 head as TiledInt8Head where streamchat's native kernels run (native=True), else
as aten's Int4Linear and Int8Head; int8 layers as Int8Linear; the input embedding as
BlockInt8Embedding. A layer no kernel takes stays as loaded. (On CUDA torchao's layouts differ
a little, and the head and the embedding stay unquantized.)
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedConfig

from streamchat.errors import ConfigError, OutOfMemoryError
from streamchat.placement.fusion import fuse_projections
from streamchat.placement.int4_linear import GROUP_SIZE, fits_int4_kernel
from streamchat.placement.int8_linear import INT8_BLOCK, fits_block_embedding, fits_int8_kernel
from streamchat.placement.native_layers import fits_native_int4, fits_native_int8, fits_native_int8_blocks

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
QUANTIZATIONS = ("none", "int8", "int4")
# TiledInt4Linear: two levels a byte, and a float16 scale and minimum per group of GROUP_SIZE inputs of a row.
INT4_PARAM_BYTES = 2 * 2
# TiledInt8Head: a float32 scale and an int32 sum of the levels per output row.
INT8_HEAD_ROW_BYTES = 4 + 4
# Int8Blocks (BlockInt8Embedding, TiledInt8Linear): a float16 scale per block of INT8_BLOCK inputs.
BLOCK_SCALE_BYTES = 2
# What a run takes beyond its weights and KV window grows with them: a prompt chunk's hidden states, MLP
# intermediates and logits, the allocator's slack between freed blocks. A tenth covers those.
HEADROOM = 1.1
# And what it takes whatever the model: the pages of torch's and transformers' libraries touched as they
# run (a process holds about 0.3 GB once both are imported), oneDNN's scratch, thread stacks, the tokenizer.
RUNTIME_BYTES = 500_000_000
GIGABYTE = 1_000_000_000  # decimal, as the hub states file sizes

MEMINFO = Path("/proc/meminfo")
CGROUP_MOUNT = Path("/sys/fs/cgroup")
OWN_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class Footprint:
    """What a model takes in memory: its weights and a KV window of `window_tokens` slots (bytes)."""

    weights: int
    kv_window: int
    window_tokens: int
    quantization: str = "none"  # how the weights are held: "none", "int8" or "int4"

    @property
    def total(self) -> int:
        return self.weights + self.kv_window


def model_footprint(
    config: PreTrainedConfig, dtype: str, quantization: str, window_tokens: int, native: bool = True
) -> Footprint:
    """The footprint of the model `config` describes, loaded in `dtype` under `quantization`, its cache `window_tokens`
    slots long."""
    weights = weight_bytes(config, dtype, quantization, native)
    return Footprint(weights, kv_window_bytes(config, window_tokens, dtype), window_tokens, quantization)


def weight_bytes(config: PreTrainedConfig, dtype: str, quantization: str, native: bool = True) -> int:
    """The bytes the model's weights take once loaded on a CPU in `dtype` and quantized (`quantization`: none, int8
    or int4), computed from its config alone; `native`: in the layouts of streamchat's own kernels, else aten's."""
    element = _dtype_bytes(dtype)
    if quantization not in QUANTIZATIONS:
        names = ", ".join(QUANTIZATIONS)
        raise ConfigError(f"cannot price weights quantized as {quantization!r}; choose one of {names}")
    # The meta device gives every tensor its shape and dtype and allocates nothing: a 7B model builds in a second.
    with torch.device("meta"):
        # A copy: from_config writes the dtype into the config it is given, and the caller's is the model's own.
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=getattr(torch, dtype))
        fuse_projections(model)  # as the loader does before quantizing: which layers fit a kernel may change
    head = model.get_output_embeddings()
    counted: set[int] = set()  # tied weights (the head and the input embedding) are one tensor until quantized
    total = 0
    for module in model.modules():
        packed = _packed_bytes(module, module is head, quantization, element, native)
        for name, parameter in module.named_parameters(recurse=False):
            if packed is not None and name == "weight":
                continue  # replaced by its packed form (a tied head and embedding each by its own)
            if id(parameter) not in counted:
                counted.add(id(parameter))
                total += parameter.numel() * parameter.element_size()
        total += packed or 0
    return total


def _packed_bytes(module: torch.nn.Module, is_head: bool, quantization: str, element: int, native: bool) -> int | None:
    """The bytes of `module`'s weight once quantize_model packs it, None where it stays as loaded."""
    if quantization != "none" and fits_block_embedding(module):
        return _block_bytes(module.num_embeddings, module.embedding_dim)
    if quantization == "none" or not isinstance(module, torch.nn.Linear):
        return None
    rows, inputs = module.out_features, module.in_features
    if is_head:  # int8 under either method: int4 costs the head 7 % perplexity (quantization.py)
        if native and fits_native_int8(module):
            return rows * inputs + rows * INT8_HEAD_ROW_BYTES
        return _int8_bytes(module, element)  # Int8Head
    if quantization == "int8" and native:  # TiledInt8Linear: a float16 scale per block, as the embedding's
        return _block_bytes(rows, inputs) if fits_native_int8_blocks(module) else None
    if quantization == "int8":
        return _int8_bytes(module, element)
    if not (fits_native_int4 if native else fits_int4_kernel)(module):
        return None
    # TiledInt4Linear keeps its scale and minimum in float16; Int4Linear its (scale, zero) pairs in dtype.
    param_bytes = INT4_PARAM_BYTES if native else 2 * element
    return rows * inputs // 2 + rows * (inputs // GROUP_SIZE) * param_bytes


def _block_bytes(rows: int, inputs: int) -> int:
    """Int8Blocks': a byte a weight and a float16 scale per block of INT8_BLOCK inputs of a row."""
    return rows * inputs + rows * (inputs // INT8_BLOCK) * BLOCK_SCALE_BYTES


def _int8_bytes(linear: torch.nn.Linear, element: int) -> int | None:
    """Int8Linear's: a byte a weight and a scale per row in dtype, None where its kernel does not take `linear`."""
    rows, inputs = linear.out_features, linear.in_features
    return rows * inputs + rows * element if fits_int8_kernel(linear) else None


def kv_window_bytes(config: PreTrainedConfig, tokens: int, dtype: str) -> int:
    """The bytes of the keys and values of `tokens` cached slots in every layer, in `dtype`."""
    text = config.get_text_config(decoder=True)  # a multimodal model's cache is its language model's
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    return 2 * text.num_hidden_layers * kv_heads * head_dim * tokens * _dtype_bytes(dtype)


def _dtype_bytes(dtype: str) -> int:
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"cannot price weights in {dtype!r}; choose one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[dtype]


# ---- the memory there is ----------------------------------------------------------------------


def available_memory(
    meminfo: Path = MEMINFO, cgroup_mount: Path = CGROUP_MOUNT, own_cgroup: Path = OWN_CGROUP
) -> int | None:
    """The bytes this process can still take on the host: the kernel's MemAvailable, or less where a cgroup (v2)
    limit leaves less; None where neither can be read (not Linux)."""
    figures = [
        figure for figure in (_mem_available(meminfo), _cgroup_room(cgroup_mount, own_cgroup)) if figure is not None
    ]
    return min(figures) if figures else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        lines = meminfo.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        key, _, value = line.partition(":")
        if key == "MemAvailable":
            return int(value.split()[0]) * 1024  # "MemAvailable:   24360756 kB"
    return None


def _cgroup_room(cgroup_mount: Path, own_cgroup: Path) -> int | None:
    """The least room any limit on this process's cgroup or its ancestors leaves, None where none is set."""
    try:
        # "0::/user.slice/app.scope": the v2 hierarchy's line; in a container's namespace "0::/".
        lines = own_cgroup.read_text().splitlines()
        relative = next(line[3:] for line in lines if line.startswith("0::")).lstrip("/")
    except (OSError, StopIteration):
        relative = ""
    own = cgroup_mount / relative
    # A limit on any ancestor binds too (a user's slice). A path not under the mount (a container
    # without its own cgroup namespace sees its host's path) is skipped up to the mount's root.
    levels = [own, *(parent for parent in own.parents if parent.is_relative_to(cgroup_mount))]
    rooms = [room for level in levels if (room := _room_under_limit(level)) is not None]
    return min(rooms) if rooms else None


def _room_under_limit(level: Path) -> int | None:
    try:
        limit = (level / "memory.max").read_text().strip()
        if limit == "max":
            return None
        used = int((level / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    # memory.current counts the page cache, which the kernel drops before it kills: a GGUF file just read
    # would otherwise count against the model converted from it. Inactive file pages are the ones it drops
    # first (what container runtimes report as the working set: current - inactive_file).
    return max(0, int(limit) - used + _inactive_file(level))


def _inactive_file(level: Path) -> int:
    try:
        lines = (level / "memory.stat").read_text().splitlines()
    except OSError:
        return 0
    return next((int(line.split()[1]) for line in lines if line.startswith("inactive_file ")), 0)


def available_device_memory(device: str) -> int | None:
    """What is free for a model on `device`: the host's available memory for "cpu", the GPU's free bytes for
    "cuda" or "cuda:N"; None where it cannot be told (another device, no CUDA here)."""
    kind = device.split(":")[0]
    if kind == "cpu":
        return available_memory()
    if kind == "cuda" and torch.cuda.is_available():
        free, _total = torch.cuda.mem_get_info(torch.device(device))
        return free
    return None


# ---- the verdict -------------------------------------------------------------------------------


def required_bytes(footprint: Footprint, headroom: float = HEADROOM) -> int:
    """What a run of a model with `footprint` needs: its weights and window with headroom, and torch's own."""
    return int(footprint.total * headroom) + RUNTIME_BYTES


def ensure_fits(name: str, footprint: Footprint, available: int | None, headroom: float = HEADROOM) -> None:
    """Raise OutOfMemoryError, in one line saying what `name` needs and what there is, where `footprint` does not fit
    in `available` bytes; nothing where the memory available is unknown (None)."""
    required = required_bytes(footprint, headroom)
    if available is None or required <= available:
        return
    held = "weights" if footprint.quantization == "none" else f"{footprint.quantization} weights"
    smaller = "pick a smaller model" if footprint.quantization == "int4" else "pick a smaller model or --quantize int4"
    raise OutOfMemoryError(
        f"{name} needs about {_gigabytes(required)} ({_gigabytes(footprint.weights)} of {held}, "
        f"{_gigabytes(footprint.kv_window)} of KV window at {footprint.window_tokens:,} tokens, "
        f"{_gigabytes(required - footprint.total)} for torch and activations) "
        f"but about {_gigabytes(available)} of memory is available; close other programs, {smaller}, or shrink --window"
    )


def _gigabytes(count: int) -> str:
    return f"{count / GIGABYTE:.1f} GB"
