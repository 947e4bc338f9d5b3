"""Quantized layers through streamchat's own kernels (placement/native.py builds them).

TiledInt4Linear: the decoder's int4 layers. aten's int4 CPU kernel widens every weight to
float32 before multiplying and rereads the weights every 4 rows. kernels/int4_rows.c splits
each activation row into two int8 parts per group of 32 and multiplies 64 levels a time with
AVX-512 VNNI, reading each tile of weights once for 8 rows: 1.5-2.2x faster than aten's at 1
to 128 rows on the default model's layers, closer to a float32 product than aten's
(scripts/int4_kernel_figures.py); on AVX2 with byte multiply-adds summed in int16 over a group,
2 rows at a time: 2.2-3.3x faster than aten's for one row, 2.0x for 128 (one thread). The
weights are Int4Linear's levels, scales and minimums (quantize_groups), scales and minimums in
float16 (as in GGUF Q4_1), packed in tiles of 16 outputs.

TiledInt8Linear: the decoder's int8 layers, in GGUF Q8_0's blocks (a float16 scale per block of 32 inputs of a
row: a Q8_0 file's weights exactly), computed by kernels/int8_blocks.c with int16 activations.

TiledInt8Head: the output head in int8 (Int8Linear's rows and scales), computed the same way
by kernels/int8_rows.c (int8_rows_avx2.c: int16 activations). Its logits come out in float32
from a product within 3e-5 of the int8 weights' exact one, so nothing needs recomputing
(Int8Head recomputes each row's best: aten's kernel rounds logits to the activations' half
precision).
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from streamchat.placement.int4_linear import GROUP_SIZE, Int4Grid, int4_grid, int8_blocks, quantize_groups
from streamchat.placement.int8_linear import INT8_BLOCK, Int8Blocks, quantize_rows
from streamchat.placement.native import TILE, NativeKernels
from streamchat.placement.packed_linear import PackedLinear


@torch.library.custom_op("streamchat::int4_rows", mutates_args=())
def _int4_rows(rows: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor, library: str) -> torch.Tensor:
    """The kernel built at `library`, as an op a compiled graph can call."""
    return _kernels_at(library).int4_rows(rows, nibbles, params)


@_int4_rows.register_fake
def _(rows: torch.Tensor, nibbles: torch.Tensor, params: torch.Tensor, library: str) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], nibbles.shape[0] * TILE)


@torch.library.custom_op("streamchat::int8_rows", mutates_args=())
def _int8_rows(
    rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor, library: str
) -> torch.Tensor:
    """The int8 kernel built at `library`, as an op a compiled graph can call."""
    return _kernels_at(library).int8_rows(rows, packed, scales, sums)


@_int8_rows.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor, library: str) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], scales.shape[0], dtype=torch.float32)


@torch.library.custom_op("streamchat::int8_blocks", mutates_args=())
def _int8_blocks(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, library: str) -> torch.Tensor:
    """The int8 block kernel built at `library`, as an op a compiled graph can call."""
    return _kernels_at(library).int8_blocks(rows, packed, scales)


@_int8_blocks.register_fake
def _(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, library: str) -> torch.Tensor:
    return rows.new_empty(rows.shape[0], packed.shape[0] * TILE)


@functools.cache
def _kernels_at(library: str) -> NativeKernels:
    return NativeKernels(Path(library))


def _kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """Rows as the kernels take them: float32 or bfloat16 (float16 activations are widened)."""
    return rows if rows.dtype in (torch.float32, torch.bfloat16) else rows.float()


def fits_native_int4(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the kernel takes: whole tiles of outputs, whole groups of inputs."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % TILE == 0


def pack_tiles(weight: torch.Tensor | Int4Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in], quantized as Int4Linear quantizes it unless it is a grid already, in the kernel's
    layout (int4_rows.c): nibbles uint8 [out / 16, in / 32, 256] and float16 params [out / 16, in / 32, 2, 16]
    (scales, minimums)."""
    levels, scale, minimum = weight if isinstance(weight, Int4Grid) else quantize_groups(weight)
    out_features, in_features = levels.shape
    tiles, groups = out_features // TILE, in_features // GROUP_SIZE
    # [out, in] -> [tiles, output, groups, pair p, nibble, input j] -> [tiles, groups, p, output, j, nibble]
    split = levels.to(torch.uint8).view(tiles, TILE, groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    nibbles = (split[..., 0] | split[..., 1] << 4).reshape(tiles, groups, 4 * TILE * 4)
    # [out, groups] -> [tiles, groups, 16] each, stacked [tiles, groups, 2, 16]
    params = torch.stack([part.view(tiles, TILE, groups).transpose(1, 2) for part in (scale, minimum)], dim=2)
    return nibbles.contiguous(), params.to(torch.float16).contiguous()


def tile_levels(nibbles: torch.Tensor) -> torch.Tensor:
    """The levels q [out, in] (uint8, 0..15) of tile-packed nibbles."""
    tiles, groups, _ = nibbles.shape
    split = nibbles.view(tiles, groups, 4, TILE, 4)  # [tiles, groups, p, output, j]
    both = torch.stack([split & 15, split >> 4], dim=-2)  # [tiles, groups, p, output, nibble, j]
    # -> [tiles, output, groups, p, nibble, j]: input 8 p + 4 nibble + j of the group
    return both.permute(0, 3, 1, 2, 4, 5).reshape(tiles * TILE, groups * GROUP_SIZE)


def unpack_tiles(nibbles: torch.Tensor, params: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] in `dtype`: q * scale + minimum."""
    levels = tile_levels(nibbles)
    out_features, in_features = levels.shape
    scale, minimum = (params[:, :, part].transpose(1, 2).reshape(out_features, -1, 1) for part in (0, 1))
    groups = levels.view(out_features, -1, GROUP_SIZE).to(dtype)  # [out, groups, 32]
    return (groups * scale.to(dtype) + minimum.to(dtype)).view(out_features, in_features)


class TiledInt4Linear(PackedLinear):
    """y = x @ W.T + bias, W = q * scale + minimum per group of GROUP_SIZE inputs, through the native kernel.

    Prompt chunks of any length run through the kernel too: widening the weights first costs
    more than the kernel saves (576 -> 3072, 128 rows: 1.5 ms, against 1.9 ms to widen and 1.2
    for the bfloat16 product).
    """

    kernel_max_rows = 1 << 62  # no chunk is widened
    nibbles: torch.Tensor  # buffers, registered in __init__
    params: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, kernels: NativeKernels) -> None:
        super().__init__(linear)
        self.kernels = kernels
        nibbles, params = pack_tiles(int4_grid(linear))
        self.register_buffer("nibbles", nibbles)
        self.register_buffer("params", params)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        taken = _kernel_rows(rows)
        if torch.compiler.is_compiling():  # a graph cannot trace a foreign call: it calls the op
            out = torch.ops.streamchat.int4_rows(taken, self.nibbles, self.params, str(self.kernels.library))
        else:
            out = self.kernels.int4_rows(taken, self.nibbles, self.params)
        return out if taken is rows else out.to(rows.dtype)  # no call on the decode path

    def levels(self) -> torch.Tensor:
        """The quantized weights q [out, in] (uint8, 0..15)."""
        return tile_levels(self.nibbles)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return unpack_tiles(self.nibbles, self.params, dtype)


def fits_native_int8_blocks(linear: torch.nn.Linear) -> bool:
    """Whether the int8 block kernel takes `linear`: whole blocks of inputs, whole tiles of outputs."""
    return linear.in_features % INT8_BLOCK == 0 and linear.out_features % TILE == 0


def pack_int8_tiles(levels: torch.Tensor) -> torch.Tensor:
    """int8 W [out, in] in the kernels' tiles [out / 16, in / 4, 16, 4]: a vector is 4 inputs of 16 outputs."""
    out_features, in_features = levels.shape
    return levels.view(out_features // TILE, TILE, in_features // 4, 4).transpose(1, 2).contiguous()


def unpack_int8_tiles(packed: torch.Tensor) -> torch.Tensor:
    """The int8 W [out, in] of tiles [out / 16, in / 4, 16, 4]."""
    tiles, quads, _, _ = packed.shape
    return packed.transpose(1, 2).reshape(tiles * TILE, quads * 4)


class TiledInt8Linear(PackedLinear):
    """y = x @ W.T + bias, W = scale * q per block of INT8_BLOCK inputs of a row (Int8Blocks), through the kernel.

    Prompt chunks of any length run through the kernel too, as TiledInt4Linear's do.
    """

    kernel_max_rows = 1 << 62  # no chunk is widened
    packed: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, kernels: NativeKernels) -> None:
        super().__init__(linear)
        self.kernels = kernels
        levels, scale = int8_blocks(linear)
        self.register_buffer("packed", pack_int8_tiles(levels))
        # [out, blocks] -> [out / 16, 16, blocks] -> [out / 16, blocks, 16]: a block's 16 scales side by side.
        tiles = scale.view(self.out_features // TILE, TILE, -1).transpose(1, 2)
        self.register_buffer("scales", tiles.contiguous())

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        taken = _kernel_rows(rows)
        if torch.compiler.is_compiling():
            out = torch.ops.streamchat.int8_blocks(taken, self.packed, self.scales, str(self.kernels.library))
        else:
            out = self.kernels.int8_blocks(taken, self.packed, self.scales)
        return out if taken is rows else out.to(rows.dtype)

    def blocks(self) -> Int8Blocks:
        """The weights as Int8Blocks (levels [out, in], scales [out, in / INT8_BLOCK])."""
        scale = self.scales.transpose(1, 2).reshape(self.out_features, -1)
        return Int8Blocks(unpack_int8_tiles(self.packed), scale)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.blocks().dense(dtype)


def fits_native_int8(linear: torch.nn.Linear) -> bool:
    """Whether the int8 kernel takes `linear`: inputs in whole vectors, whole tiles of outputs."""
    return linear.in_features % TILE == 0 and linear.out_features % TILE == 0


class TiledInt8Head(PackedLinear):
    """logits = x @ (scales * W).T + bias in float32, W int8 per output row as Int8Linear quantizes it."""

    kernel_max_rows = 1 << 62  # the kernel at any number of rows: a prompt's logits are few anyway
    packed: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor
    sums: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, kernels: NativeKernels) -> None:
        super().__init__(linear)
        self.kernels = kernels
        weight, scales = quantize_rows(linear.weight.detach())
        self.register_buffer("packed", pack_int8_tiles(weight))
        self.register_buffer("scales", scales)
        self.register_buffer("sums", weight.sum(dim=1, dtype=torch.int32))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        taken = _kernel_rows(rows)
        if torch.compiler.is_compiling():
            library = str(self.kernels.library)
            return torch.ops.streamchat.int8_rows(taken, self.packed, self.scales, self.sums, library)
        return self.kernels.int8_rows(taken, self.packed, self.scales, self.sums)

    def rows_int8(self) -> torch.Tensor:
        """The int8 weights W [out, in]."""
        return unpack_int8_tiles(self.packed)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.rows_int8().float() * self.scales[:, None]).to(dtype)
