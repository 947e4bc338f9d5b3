"""streamchat's own CPU kernels (placement/kernels/*.c), built once per machine by its C compiler.

    kernels = load_native_kernels(directory)      # None where they cannot be built or run here
    kernels.int4_rows(rows, nibbles, params)      # int4 weights times activation rows (native_layers.py)
    kernels.int8_rows(rows, packed, scales, sums) # int8 weights: the output head's float32 logits
    kernels.int8_blocks(rows, packed, scales)     # int8 weights in Q8_0's blocks (native_layers.py)
    kernels.decode_attention(query, keys, values, mask, scale)    # one query a row (attention.py)
    kernels.decode_attention_int8(query, window, mask, scale)     # the same over an int8 cache's window
    kernels.rms_norm(hidden, weight, eps)         # LlamaRMSNorm of bfloat16 rows (lean_forward.py)
    kernels.decode_layers(table, dims, ...)       # every layer of a one-token pass (lean_forward.py)
    use_native_kernels(kernels)                   # what attention and the lean forward call, in this process

Where torch's CPU kernels leave most of a decode pass's time on the table (aten's int4
and int8 products reread the weights every 4 rows and widen each to float32; a bfloat16
matrix product costs ~100 us a call whatever its size), these are small C files written once
against 16-lane vectors (kernels/vectors.h), threaded by OpenMP: linked to libgomp, the runtime
torch loaded, so they share its thread pool. They are built for the best variant this CPU runs
(Linux on x86-64, a C compiler, $CC else cc, that takes -fopenmp): AVX-512 with VNNI, else
AVX2 with FMA and F16C (most laptops' CPUs), the same packed weights for both.
STREAMCHAT_NATIVE_KERNELS=avx2 asks for a variant by name, =0 for none. The shared library
goes to streamchat's cache dir under a name hashed from the sources and flags, so a machine
builds it once (a few seconds), and each kernel is checked against torch before first use
(decode_layers: a tiny synthetic layer set, against the lean forward's torch operations).
Anywhere else, if the build or a check fails, there are no native kernels and every caller
keeps torch's (the same results within rounding).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import subprocess
import tempfile
from pathlib import Path

import torch

from streamchat.cache.quantized_kv import QuantizedWindow, quantize
from streamchat.placement.device import Variant, c_compiler, chosen_variant, cpu_flags, kernels_asked

TILE = 16  # outputs a tile of int4 weights holds: one vector lane each (int4_rows.c)
KERNELS = Path(__file__).parent / "kernels"
SOURCES = tuple(sorted(KERNELS.glob("*.c")))  # compiled together into one library
HEADERS = tuple(sorted(KERNELS.glob("*.h")))  # what they share: part of what names a build
# No fused multiply-add where torch rounds twice.
COMMON_FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off")
BUILD_TIMEOUT_S = 120
# Far above what the kernels' rounding gives (about 0.2 %): a check that finds more is a broken build.
CHECK_TOLERANCE = 0.02


# kernels.h's C types as ctypes takes them: every pointer is an address (c_void_p), "void" returns nothing.
_C_TYPES = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float, "void": None}
_DECLARATION = re.compile(r"^(\w+)\s+(\w+)\(([^)]*)\);", re.MULTILINE)
_SHAPE_NOT_TAKEN = 1  # decode_attention's answer for shapes it does not take


def kernel_signatures(header: str) -> dict[str, tuple[object, list[object]]]:
    """Each function kernels.h declares: its ctypes return type and argument types, read from the header
    itself, so that the bindings cannot drift from the C signatures."""
    signatures: dict[str, tuple[object, list[object]]] = {}
    for returned, name, parameters in _DECLARATION.findall(header):
        arguments = []
        for parameter in parameters.split(","):
            words = parameter.replace("*", " * ").split()
            arguments.append(ctypes.c_void_p if "*" in words else _c_type(words[-2], name))
        signatures[name] = (_c_type(returned, name), arguments)
    return signatures


def _c_type(spelled: str, function: str) -> object:
    if spelled not in _C_TYPES:
        raise ValueError(f"kernels.h: {function} uses the type {spelled}, which has no binding in native.py")
    return _C_TYPES[spelled]


class NativeKernels:
    """The built library's kernels, called on tensors."""

    def __init__(self, library: Path) -> None:
        self.library = library
        self.variant = library.name.split("-")[2]  # "avx2": _built names a library after its variant
        loaded = ctypes.CDLL(str(library))
        for name, (returned, arguments) in kernel_signatures((KERNELS / "kernels.h").read_text()).items():
            function = getattr(loaded, name)
            function.argtypes, function.restype = arguments, returned
        self._int4_rows, self._int8_rows, self._attention = loaded.int4_rows, loaded.int8_rows, loaded.decode_attention
        self._int8_blocks = loaded.int8_blocks
        self._rms_norm, self._decode_layers = loaded.rms_norm, loaded.decode_layers
        self._attention_int8 = loaded.decode_attention_int8

    def int4_rows(self, rows: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """rows [n, in] (contiguous, float32 or bfloat16) @ W.T for tile-packed int4 W: [n, out], the rows' dtype."""
        count, in_features = rows.shape
        out = torch.empty(count, nibbles.shape[0] * TILE, dtype=rows.dtype)
        half = rows.dtype == torch.bfloat16
        failed = self._int4_rows(
            rows.data_ptr(), half, count, in_features, nibbles.data_ptr(), params.data_ptr(), out.shape[1],
            out.data_ptr(), half, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"the int4 kernel could not allocate scratch memory for {count} rows")
        return out

    def int8_rows(
        self, rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor
    ) -> torch.Tensor:
        """rows [n, in] (contiguous, float32 or bfloat16) @ (scales * W).T for tile-packed int8 W [out / 16, in / 4,
        16, 4] with float32 scales [out] and int32 row sums [out]: float32 [n, out]."""
        count, in_features = rows.shape
        out = torch.empty(count, scales.shape[0], dtype=torch.float32)
        failed = self._int8_rows(
            rows.data_ptr(), rows.dtype == torch.bfloat16, count, in_features, packed.data_ptr(), scales.data_ptr(),
            sums.data_ptr(), out.shape[1], out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"the int8 kernel could not allocate scratch memory for {count} rows")
        return out

    def int8_blocks(self, rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """rows [n, in] (contiguous, float32 or bfloat16) @ W.T for int8 W in int8_rows' tiles [out / 16, in / 4, 16,
        4] with a float16 scale per block of 32 inputs, [out / 16, in / 32, 16]: [n, out], the rows' dtype."""
        count, in_features = rows.shape
        out = torch.empty(count, packed.shape[0] * TILE, dtype=rows.dtype)
        half = rows.dtype == torch.bfloat16
        failed = self._int8_blocks(
            rows.data_ptr(), half, count, in_features, packed.data_ptr(), scales.data_ptr(), out.shape[1],
            out.data_ptr(), half, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"the int8 kernel could not allocate scratch memory for {count} rows")
        return out

    def decode_attention(
        self, query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor | None:
        """Attention [B, KV, G, Dv] of query [B, KV, G, D] (contiguous) over keys [B, KV, S, D] and values
        [B, KV, S, Dv] (each slot's vector contiguous), float32 terms mask [B or 1, 1, 1, S] added to the
        scores, or None; all float32 or all bfloat16. None for what the kernel does not take."""
        batch, kv_heads, groups, dim = query.shape
        slots, value_dim = values.shape[2], values.shape[3]
        if not (query.dtype == keys.dtype == values.dtype and query.dtype in (torch.float32, torch.bfloat16)):
            return None
        if keys.stride()[2:] != (dim, 1) or values.stride()[2:] != (value_dim, 1) or not query.is_contiguous():
            return None
        if mask is not None and (mask.dtype != torch.float32 or mask.stride(-1) != 1):
            return None
        out = torch.empty(batch, kv_heads, groups, value_dim, dtype=query.dtype)
        mask_batch = mask.stride(0) if mask is not None and mask.shape[0] > 1 else 0
        half = query.dtype == torch.bfloat16
        answer = self._attention(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), 0 if mask is None else mask.data_ptr(),
            out.data_ptr(), batch, kv_heads, groups, dim, value_dim, slots, keys.stride(0), keys.stride(1),
            values.stride(0), values.stride(1), mask_batch, scale, half, torch.get_num_threads(),
        )  # fmt: skip
        return _attended(answer, out, batch)

    def decode_attention_int8(
        self, query: torch.Tensor, window: QuantizedWindow, mask: torch.Tensor | None, scale: float
    ) -> torch.Tensor | None:
        """decode_attention over an int8 cache's window (cache/quantized_kv.py) as it is stored: query [B, KV, G,
        D] (contiguous) in the window's dtype (float32 or bfloat16), levels [B, KV, S, D] with their scales, each
        row's exact sinks; None for what the kernel does not take."""
        batch, kv_heads, groups, dim = query.shape
        keys, values, key_scales, value_scales, sink_keys, sink_values, sinks = window
        if query.dtype != sink_keys.dtype or query.dtype not in (torch.float32, torch.bfloat16):
            return None
        alike = keys.stride() == values.stride() and key_scales.stride() == value_scales.stride()
        alike = alike and sink_keys.stride() == sink_values.stride() and values.shape[3] == dim
        if not alike or keys.stride()[2:] != (dim, 1) or sink_keys.stride()[2:] != (dim, 1):
            return None
        if key_scales.stride(2) != 1 or not query.is_contiguous():
            return None
        if mask is not None and (mask.dtype != torch.float32 or mask.stride(-1) != 1):
            return None
        out = torch.empty(batch, kv_heads, groups, dim, dtype=query.dtype)
        mask_batch = mask.stride(0) if mask is not None and mask.shape[0] > 1 else 0
        shape = torch.tensor(
            [batch, kv_heads, groups, dim, keys.shape[2], *keys.stride()[:2], *key_scales.stride()[:2],
             *sink_keys.stride()[:2], mask_batch]
        )  # fmt: skip
        rows_sinks = sinks.to(torch.int64).contiguous()
        answer = self._attention_int8(
            query.data_ptr(), keys.data_ptr(), values.data_ptr(), key_scales.data_ptr(), value_scales.data_ptr(),
            sink_keys.data_ptr(), sink_values.data_ptr(), rows_sinks.data_ptr(),
            0 if mask is None else mask.data_ptr(), out.data_ptr(), shape.data_ptr(), scale,
            query.dtype == torch.bfloat16, torch.get_num_threads(),
        )  # fmt: skip
        return _attended(answer, out, batch)

    def rms_norm(self, hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """LlamaRMSNorm of bfloat16 hidden [..., dim] with a bfloat16 weight [dim]; None for what it does not take."""
        dim = hidden.shape[-1]
        taken = hidden.dtype == weight.dtype == torch.bfloat16 and dim % 16 == 0 and weight.is_contiguous()
        if not taken or not hidden.is_contiguous():
            return None
        out = torch.empty_like(hidden)
        self._rms_norm(hidden.data_ptr(), weight.data_ptr(), out.data_ptr(), hidden.numel() // dim, dim, eps)
        return out

    def decode_layers(
        self,
        table: torch.Tensor,
        dims: torch.Tensor,
        slots: torch.Tensor,
        sinks: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        sink_cos: torch.Tensor,
        sink_sin: torch.Tensor,
        mask: torch.Tensor | None,
        eps: float,
        scale: float,
    ) -> None:
        """Every layer of a one-token pass for each row of hidden [rows, hidden_size] (bfloat16, contiguous),
        overwritten with the last layer's output; the int64 table [layers, fields] and dims, and the rows'
        slots, sinks and angles, as kernels/decode_layers.c lays them out."""
        answer = self._decode_layers(
            table.data_ptr(), table.shape[0], dims.data_ptr(), slots.data_ptr(), sinks.data_ptr(), hidden.data_ptr(),
            cos.data_ptr(), sin.data_ptr(), sink_cos.data_ptr(), sink_sin.data_ptr(),
            0 if mask is None else mask.data_ptr(), eps, scale, torch.get_num_threads(),
        )  # fmt: skip
        if answer == _SHAPE_NOT_TAKEN:
            raise ValueError(f"the decode layers kernel does not take these sizes: {dims.tolist()}")
        if answer:
            raise MemoryError("the decode layers kernel could not allocate scratch memory")


def _attended(answer: int, out: torch.Tensor, batch: int) -> torch.Tensor | None:
    """What an attention kernel's answer means: `out` written, None for a shape it does not take."""
    if answer == _SHAPE_NOT_TAKEN:
        return None
    if answer:
        raise MemoryError(f"the attention kernel could not allocate scratch memory for {batch} rows")
    return out


_IN_USE: list[NativeKernels] = []  # what use_native_kernels gave, if anything


def use_native_kernels(kernels: NativeKernels | None) -> None:
    """Decode attention and the lean forward's norms go through `kernels` from now on, in this process (None:
    torch's operations). The loader turns them on for a bfloat16 or int4 model on a CPU that runs them."""
    _IN_USE[:] = [] if kernels is None else [kernels]


def native_in_use() -> NativeKernels | None:
    return _IN_USE[0] if _IN_USE else None


@functools.cache
def load_native_kernels(directory: Path, asked: str | None = None) -> NativeKernels | None:
    """The kernels, built into `directory` if not there yet; None where they cannot be built or run here.
    `asked` names a variant ("avx2"), as STREAMCHAT_NATIVE_KERNELS does when it is None."""
    variant = chosen_variant(kernels_asked(asked), cpu_flags())
    if variant is None:
        return None
    try:
        kernels = NativeKernels(_built(directory, variant))
        return kernels if _checks_out(kernels) else None
    except (OSError, subprocess.SubprocessError, ValueError, MemoryError):  # not built or bound, or a check raised
        return None


def _built(directory: Path, variant: Variant) -> Path:
    """The shared library of these sources and flags, compiled once: a finished build is renamed in whole."""
    flags = COMMON_FLAGS + variant.compiler_flags
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in SOURCES + HEADERS) + " ".join(flags).encode())
    library = directory / f"streamchat-kernels-{variant.name}-{digest.hexdigest()[:16]}.so"
    if library.exists():
        return library
    compiler = c_compiler()
    if compiler is None:
        raise OSError("no C compiler")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as building:
        partial = Path(building) / library.name
        command = [compiler, *flags, "-o", str(partial), *map(str, SOURCES)]
        subprocess.run(command, capture_output=True, check=True, timeout=BUILD_TIMEOUT_S)
        os.replace(partial, library)
    return library


def _checks_out(kernels: NativeKernels) -> bool:
    """Whether each kernel agrees with torch on small random inputs (decode_layers, which calls the others, last)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(3, 64, generator=generator)
    # Every level 1, scale 1, minimum 0: W is all ones, each output its row's sum.
    nibbles = torch.full((2, 2, 256), 0x11, dtype=torch.uint8)
    params = torch.stack([torch.ones(2, 2, TILE), torch.zeros(2, 2, TILE)], dim=2).half()
    row_sums = rows.sum(dim=1, keepdim=True).expand(3, 32)
    int4_agrees = _close(kernels.int4_rows(rows, nibbles, params), row_sums)
    # Every weight 1, scale 1 again, in int8 tiles [out / 16, in / 4, 16, 4].
    ones = torch.ones(2, 16, 16, 4, dtype=torch.int8)
    int8_agrees = _close(
        kernels.int8_rows(rows, ones, torch.ones(32), torch.full((32,), 64, dtype=torch.int32)), row_sums
    )
    # The same weights in blocks of 32, each block's scale random: each output its blocks' sums, scaled.
    block_scales = torch.rand(2, 2, TILE, generator=generator).half()  # [tiles, blocks, 16]
    scaled_sums = rows.view(3, 2, 32).sum(dim=-1) @ block_scales.float().permute(1, 0, 2).reshape(2, 32)
    int8_agrees = int8_agrees and _close(kernels.int8_blocks(rows, ones, block_scales), scaled_sums)
    query = torch.randn(2, 2, 3, 64, generator=generator)  # [batch, kv heads, groups, dim]; 64: AVX2's int8 scoring
    keys, values = (torch.randn(2, 2, 9, 64, generator=generator) for _ in "kv")
    mask = torch.zeros(2, 1, 1, 9)
    mask[1, ..., :4] = torch.finfo(torch.float32).min
    expected = torch.softmax(query @ keys.transpose(-1, -2) * 0.5 + mask, dim=-1) @ values
    attended = kernels.decode_attention(query, keys, values, mask, 0.5)
    attention_agrees = attended is not None and _close(attended, expected)
    # The same over an int8 window, its first 2 slots exact sinks: against the window widened.
    (key_levels, key_scales), (value_levels, value_scales) = quantize(keys), quantize(values)
    sinks = (keys[:, :, :2].contiguous(), values[:, :, :2].contiguous(), torch.full((2,), 2))
    window = QuantizedWindow(key_levels, value_levels, key_scales, value_scales, *sinks)
    attended = kernels.decode_attention_int8(query, window, mask, 0.5)
    widened_keys, widened_values = window.widened()
    expected = torch.softmax(query @ widened_keys.transpose(-1, -2) * 0.5 + mask, dim=-1) @ widened_values
    attention_agrees = attention_agrees and attended is not None and _close(attended, expected)
    hidden, weight = rows.bfloat16(), torch.randn(64, generator=generator).bfloat16()
    return (
        int4_agrees
        and int8_agrees
        and attention_agrees
        and (norm := kernels.rms_norm(hidden, weight, 1e-5)) is not None
        and _close(norm, _rms_norm(hidden, weight))
        and _decode_layers_agree(kernels, generator)
    )


# decode_layers' check: 2 query heads over 1 key/value head; a full bfloat16 cache, each row with its own sinks.
_LAYERS, _ROWS, _HIDDEN, _INTERMEDIATE, _Q_HEADS, _HEAD_DIM, _SLOTS, _SINKS = 2, 2, 32, 32, 2, 16, 6, 2
# A synthetic layer: its two norms; qkv, o_proj, gate_up and down (nibbles, params); keys, values, pristine, partners.
_Layer = tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]], list[torch.Tensor]]


def _decode_layers_agree(kernels: NativeKernels, generator: torch.Generator) -> bool:
    """Whether decode_layers runs a tiny synthetic layer set as the lean forward's torch operations do
    (_lean_layers), within CHECK_TOLERANCE: the rows' hidden states, and the keys and values it writes (each
    row's new token in its slot, its sinks turned). Its table of raw addresses and its dims are laid out as
    lean_forward.FusedDecode lays them out for a full cache (whose key scales and exact sinks are its keys)."""

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    def int4(out: int, inputs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tile-packed random levels, each group's scale random and its minimum -8 scales (native_layers.py)."""
        nibbles = torch.randint(0, 256, (out // TILE, inputs // 32, 256), dtype=torch.uint8, generator=generator)
        scales = torch.rand(out // TILE, inputs // 32, 1, TILE, generator=generator) * 0.02 + 0.005
        return nibbles, torch.cat([scales, -8 * scales], dim=2).half()

    # qkv (the query heads, a key, a value), o_proj, gate_up, down: [out, in] each.
    shapes = [((_Q_HEADS + 2) * _HEAD_DIM, _HIDDEN), (_HIDDEN, _Q_HEADS * _HEAD_DIM)]
    shapes += [(2 * _INTERMEDIATE, _HIDDEN), (_HIDDEN, _INTERMEDIATE)]
    cached = [(_ROWS, 1, _SLOTS, _HEAD_DIM)] * 2  # keys, values; then the sinks' pristine keys, their partners
    layers: list[_Layer] = [
        ([(1 + random(_HIDDEN) / 8).bfloat16() for _ in "io"], [int4(*shape) for shape in shapes],
         [random(*shape).bfloat16() for shape in cached] + [random(_ROWS, 1, _SINKS, _HEAD_DIM) for _ in "pq"])
        for _ in range(_LAYERS)
    ]  # fmt: skip
    table = torch.tensor(
        [
            [norm.data_ptr() for norm in norms]
            + [address for nibbles, params in projections for address in (nibbles.data_ptr(), params.data_ptr(), 0)]
            + [tensor.data_ptr() for tensor in (*cache, *cache[:2], *cache[:2])]
            for norms, projections, cache in layers
        ]
    )
    keys, pristine = layers[0][2][0].stride()[:2], layers[0][2][2].stride()[:2]
    sizes = [_HIDDEN, _Q_HEADS, 1, _HEAD_DIM, _INTERMEDIATE, _ROWS]  # then the strides; the key scales' are the keys'
    dims = torch.tensor([*sizes, *keys, *keys, *pristine, _HEAD_DIM, _SLOTS, 0, *keys, *keys])
    angles, sink_angles = (random(_ROWS, _HEAD_DIM // 2).repeat(1, 2) for _ in "as")  # rotate_half's layout
    signs = torch.tensor([-1.0, 1.0]).repeat_interleave(_HEAD_DIM // 2)  # sin signed, as lean_forward signs it
    cos, sin = angles.cos().bfloat16(), (angles.sin() * signs).bfloat16()
    mask = torch.zeros(_ROWS, _SLOTS)
    mask[0, 4:] = mask[1, 1] = torch.finfo(torch.float32).min  # slots that hold no token of the row's
    # Each row's slot and sinks, its angles, its sinks' angles, its mask: as decode_layers takes them.
    rows = (torch.tensor([3, 5]), torch.tensor([2, 1]), cos, sin, sink_angles.cos(), sink_angles.sin(), mask)
    hidden = random(_ROWS, _HIDDEN).bfloat16()
    expected, caches = _lean_layers(kernels, layers, hidden, rows)
    kernels.decode_layers(table, dims, rows[0], rows[1], hidden, *rows[2:], 1e-5, _HEAD_DIM**-0.5)
    written = [tensor for _, _, cache in layers for tensor in cache[:2]]
    return _close(hidden, expected) and all(_close(got, want) for got, want in zip(written, caches, strict=True))


def _lean_layers(
    kernels: NativeKernels, layers: list[_Layer], hidden: torch.Tensor, rows: tuple[torch.Tensor, ...]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """hidden [rows, hidden] after `layers`, as lean_forward.LeanForward's layer loop computes it over a full
    bfloat16 cache: torch's operations in the same dtypes, the int4 products through int4_rows; and copies of each
    layer's keys and values written as SinkLayer.decode writes them, the sinks turned from pristine."""
    slots, sinks, cos, sin, sink_cos, sink_sin, mask = rows
    caches = []
    for norms, (qkv, o_proj, gate_up, down), (*stored, pristine, partners) in layers:
        keys, values = (tensor.clone() for tensor in stored)
        heads = kernels.int4_rows(_rms_norm(hidden, norms[0]), *qkv).view(len(hidden), -1, _HEAD_DIM)  # q..., k, v
        turned = heads[:, :-1] * cos[:, None] + heads[:, :-1].roll(_HEAD_DIM // 2, dims=-1) * sin[:, None]
        for row, (slot, count) in enumerate(zip(slots.tolist(), sinks.tolist(), strict=True)):
            keys[row, 0, slot], values[row, 0, slot] = turned[row, -1], heads[row, -1]
            placed = torch.addcmul(pristine[row, :, :count] * sink_cos[row], partners[row, :, :count], sink_sin[row])
            keys[row, :, :count] = placed.bfloat16()
        # [rows, key/value heads, query heads a key head, head_dim]: each query over its row's slots.
        scores = turned[:, None, :-1].float() @ keys.float().transpose(-1, -2) * _HEAD_DIM**-0.5 + mask[:, None, None]
        attended = (torch.softmax(scores, dim=-1) @ values.float()).bfloat16().reshape(len(hidden), -1)
        hidden = hidden + kernels.int4_rows(attended, *o_proj)
        gate, up = kernels.int4_rows(_rms_norm(hidden, norms[1]), *gate_up).chunk(2, dim=-1)
        hidden = hidden + kernels.int4_rows(torch.nn.functional.silu(gate) * up, *down)
        caches += [keys, values]
    return hidden, caches


def _rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LlamaRMSNorm's operations on bfloat16 rows, as lean_forward runs them without the kernel."""
    wide = hidden.float()
    return weight * (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + eps)).bfloat16()


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return bool((got - expected).norm() / expected.norm() < CHECK_TOLERANCE)
