"""TiledInt4Linear: int4 linear layers through streamchat's own kernel, built once per machine by its C compiler.

aten's int4 CPU kernel widens every weight to float32 before multiplying and rereads the
weights every 4 rows. kernels/int4_rows.c quantizes each activation row to int8 per group of
32 (llama.cpp's Q8 blocks) and multiplies 64 levels a time with AVX-512 VNNI, reading each
tile of weights once for 8 rows: 576 -> 3072 in bfloat16 on 2 threads, 1/8/64 rows take
28/78/576 us against aten's 111/233/1777 (scripts/row_product_figures.py).

It is built where it can run: Linux on x86-64 with AVX-512 VNNI and a C compiler ($CC, else
cc) that takes -fopenmp. The shared library goes to streamchat's cache dir under a name
hashed from the source and flags, so a machine builds it once (about a second), and it is
checked against a float product before first use. Anywhere else, if the build or the check
fails, or with STREAMCHAT_NATIVE_KERNELS=0, load_int4_kernel gives None and int4 layers use
aten's kernel (Int4Linear). The weights are the same levels, steps and minimums as
Int4Linear's (quantize_groups), steps and minimums stored in float16 (as in GGUF Q4_1).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from streamchat import defaults
from streamchat.placement.int4_linear import GROUP_SIZE, quantize_groups
from streamchat.placement.packed_linear import PackedLinear

TILE = 16  # outputs a tile of packed weights holds: one vector lane each
SOURCE = Path(__file__).parent / "kernels" / "int4_rows.c"
FLAGS = ("-O3", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq")
FLAGS += ("-mavx512vnni", "-mfma", "-mf16c")
CPU_FLAGS = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "fma", "f16c"}  # as /proc/cpuinfo names them
BUILD_TIMEOUT_S = 120
# Quantizing activations to int8 costs about 1 % of a product's size in error, an int4 grid's own
# error is several times that: a self-check that finds more is a broken build.
CHECK_TOLERANCE = 0.05


class Int4Kernel:
    """The built kernel: products of activation rows [n, in] and tile-packed int4 weights."""

    def __init__(self, library: Path) -> None:
        self.library = library
        self._function = ctypes.CDLL(str(library)).int4_rows
        self._function.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
        self._function.argtypes += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        self._function.restype = ctypes.c_int

    def __call__(self, rows: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
        """rows [n, in] (contiguous, float32 or bfloat16) @ W.T: [n, out] in the rows' dtype."""
        count, in_features = rows.shape
        out = torch.empty(count, nibbles.shape[0] * TILE, dtype=rows.dtype)
        half = rows.dtype == torch.bfloat16
        failed = self._function(
            rows.data_ptr(), half, count, in_features, nibbles.data_ptr(), params.data_ptr(), out.shape[1],
            out.data_ptr(), half, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError(f"the int4 kernel could not allocate scratch memory for {count} rows")
        return out


@torch.library.custom_op("streamchat::int4_rows", mutates_args=())
def _int4_rows(rows: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor, library: str) -> torch.Tensor:
    """The kernel built at `library`, as an op a compiled step can call."""
    return _kernel_at(library)(rows, nibbles, params)


@_int4_rows.register_fake
def _(rows: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor, library: str) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], nibbles.shape[0] * TILE)


@functools.cache
def _kernel_at(library: str) -> Int4Kernel:
    return Int4Kernel(Path(library))


def fits_native_int4(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the kernel takes: whole tiles of outputs, whole groups of inputs."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % TILE == 0


@functools.cache
def load_int4_kernel(directory: Path) -> Int4Kernel | None:
    """The kernel, built into `directory` if not there yet; None where it cannot be built or run here."""
    if os.environ.get(defaults.NATIVE_KERNELS_ENV) == "0" or not _cpu_runs_it():
        return None
    try:
        kernel = Int4Kernel(_built(directory))
    except (OSError, subprocess.SubprocessError):
        return None
    return kernel if _checks_out(kernel) else None


def _cpu_runs_it() -> bool:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return CPU_FLAGS.issubset(flags)


def _built(directory: Path) -> Path:
    """The shared library for this source and these flags, compiled once: a finished build is renamed in whole."""
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    library = directory / f"int4_rows-{digest}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as building:
        partial = Path(building) / library.name
        subprocess.run(
            [compiler, *FLAGS, "-o", str(partial), str(SOURCE)],
            capture_output=True,
            check=True,
            timeout=BUILD_TIMEOUT_S,
        )
        os.replace(partial, library)
    return library


def _checks_out(kernel: Int4Kernel) -> bool:
    """Whether the kernel's product of a few random rows and weights matches a float32 product."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(2 * TILE, 2 * GROUP_SIZE, generator=generator)
    rows = torch.randn(3, 2 * GROUP_SIZE, generator=generator)
    nibbles, params = pack_tiles(weight)
    expected = rows @ unpack_tiles(nibbles, params, torch.float32).T
    error = (kernel(rows, nibbles, params) - expected).norm() / expected.norm()
    return bool(error < CHECK_TOLERANCE)


def pack_tiles(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] quantized as Int4Linear quantizes it, in the kernel's layout (int4_rows.c):
    nibbles uint8 [out / 16, in / 32, 256] and float16 params [out / 16, in / 32, 2, 16] (steps, minimums)."""
    levels, step, minimum = quantize_groups(weight)
    out_features, in_features = levels.shape
    tiles, groups = out_features // TILE, in_features // GROUP_SIZE
    # [out, in] -> [tiles, output, groups, pair p, nibble, input j] -> [tiles, groups, p, output, j, nibble]
    split = levels.to(torch.uint8).view(tiles, TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (split[..., 0] | split[..., 1] << 4).reshape(tiles, groups, 4 * TILE * 4)
    # [out, groups] -> [tiles, groups, 16] each, stacked [tiles, groups, 2, 16]
    params = torch.stack([part.view(tiles, TILE, groups).transpose(1, 2) for part in (step, minimum)], dim=2)
    return nibbles.contiguous(), params.to(torch.float16).contiguous()


def tile_levels(nibbles: torch.Tensor) -> torch.Tensor:
    """The levels q [out, in] (uint8, 0..15) of tile-packed nibbles."""
    tiles, groups, _ = nibbles.shape
    split = nibbles.view(tiles, groups, 4, TILE, 4)  # [tiles, groups, p, output, j]
    both = torch.stack([split & 15, split >> 4], dim=-2)  # [tiles, groups, p, output, nibble, j]
    # -> [tiles, output, groups, p, nibble, j]: input 8 p + 4 nibble + j of the group
    return both.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, groups * GROUP_SIZE)


def unpack_tiles(nibbles: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] in `dtype`: q * step + minimum."""
    levels = tile_levels(nibbles)
    out_features, in_features = levels.shape
    step, minimum = (params[:, :, part].transpose(1, 2).reshape(out_features, -1, 1) for part in (0, 1))
    groups = levels.view(out_features, -1, GROUP_SIZE).to(dtype)  # [out, groups, 32]
    return (groups * step.to(dtype) + minimum.to(dtype)).view(out_features, in_features)


class TiledInt4Linear(PackedLinear):
    """y = x @ W.T + bias, W = q * step + minimum per group of GROUP_SIZE inputs, through the native kernel.

    The kernel is faster than a widened product at any number of rows (576 -> 3072, 128 rows:
    1.1 ms against 3.0), so prompt chunks of every length run through it too.
    """

    kernel_max_rows = 1 << 62

    def __init__(self, linear: torch.nn.Linear, kernel: Int4Kernel) -> None:
        super().__init__(linear)
        self.kernel = kernel
        nibbles, params = pack_tiles(linear.weight.detach())
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("params", params)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dtype not in (torch.float32, torch.bfloat16):  # float16 activations
            return self.product(rows.float()).to(rows.dtype)
        if torch.compiler.is_compiling():  # a graph cannot trace a foreign call: it calls the op
            return torch.ops.streamchat.int4_rows(rows, self.nibbles, self.params, str(self.kernel.library))
        return self.kernel(rows, self.nibbles, self.params)

    def levels(self) -> torch.Tensor:
        """The quantized weights q [out, in] (uint8, 0..15)."""
        return tile_levels(self.nibbles)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return unpack_tiles(self.nibbles, self.params, dtype)
