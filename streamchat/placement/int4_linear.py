"""Int4Linear: a linear layer with 4-bit weights in groups, computed by aten's CPU int4 kernel.

`torch.ops.aten._weight_int4pack_mm_for_cpu` dequantizes in registers: for one activation
row it reads half the bytes of the int8 kernel (single-thread on an AVX-512 CPU: 60 us against
205 us for 576 -> 1536, shared/notes/performance.md).
torchao reaches the same kernel through a tensor subclass whose dispatch costs tens of
microseconds per call, which on a small model ate the gain (211 products a token), so
this module calls the kernel itself, as Int8Linear does for int8 (placement/packed_linear.py:
when it runs the kernel and when it widens the weights instead).

Each group of GROUP_SIZE inputs of an output row keeps its own minimum and scale (the
GGUF Q4_1 scheme, whose blocks are 32 wide: weights that came from a Q4_1 file come back
on the same grid): w = q * scale + minimum, q in 0..15. The kernel takes the pair as
(scale, minimum + 8 * scale), in the activations' dtype.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from streamchat.placement.int8_linear import QUANTIZED_ROWS, Int8Blocks, quantize_blocks
from streamchat.placement.packed_linear import PackedLinear

GROUP_SIZE = 32
LEVELS = 15  # q in 0..15
# Widening int4 weights costs more than int8's (576 -> 3072: 1.9 ms): the kernel stays the faster up to
# about 128 rows (bfloat16, AVX-512, 2 threads: 64 rows 1.4 ms against 2.7 widened, 128 rows 2.8 against
# 3.0, 256 rows 5.8 against 4.3), so prompt chunks of up to 128 tokens run through it.
INT4_KERNEL_MAX_ROWS = 128


class PackedLayout(NamedTuple):
    """How aten packs int4 weights on this CPU: `block` output rows at a time, [out / block, in, block / 2]
    bytes; `paired`: rows 2j and 2j + 1 of a block share byte j, else rows j and block / 2 + j do."""

    block: int
    paired: bool


# aten's layouts by CPU capability (int4mm_kernel.cpp): AVX-512, AVX2, none. Prompt chunks widen the
# weights from the packed ones, so layers whose outputs are not whole blocks stay as they are (aten
# packs a last partial block differently).
KNOWN_LAYOUTS = (PackedLayout(64, paired=False), PackedLayout(32, paired=False), PackedLayout(32, paired=True))


def fits_int4_kernel(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the int4 kernel takes, in the packed layout this module reads."""
    layout = packed_layout()
    return layout is not None and linear.in_features % GROUP_SIZE == 0 and linear.out_features % layout.block == 0


@functools.cache
def packed_layout() -> PackedLayout | None:
    """The layout this torch packs int4 weights in on this CPU, None if not one levels() reads (probed once)."""
    rows = max(layout.block for layout in KNOWN_LAYOUTS) * 2
    probe = torch.randint(0, 16, (rows, GROUP_SIZE), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    if packed.numel() * 2 != probe.numel():
        return None
    readable = (
        layout for layout in KNOWN_LAYOUTS if torch.equal(_unpack(packed, layout, *probe.shape), probe.to(torch.uint8))
    )
    return next(readable, None)


class Int4Grid(NamedTuple):
    """Weights on a 4-bit grid, each group of GROUP_SIZE inputs of an output row with its own scale and minimum:
    w = levels * scale + minimum. GGUF's Q4_1 blocks are such groups; Q4_0's are too, with minimum = -8 * scale."""

    levels: torch.Tensor  # [out, in], integers 0..15
    scale: torch.Tensor  # [out, in / GROUP_SIZE]: the distance between two levels
    minimum: torch.Tensor  # [out, in / GROUP_SIZE]

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype`, computed in float32 (a product and a sum, each rounded once)."""
        out_features, in_features = self.levels.shape
        groups = self.levels.view(out_features, -1, GROUP_SIZE).float()  # [out, groups, 32]
        weight = groups * self.scale.float()[..., None] + self.minimum.float()[..., None]
        return weight.view(out_features, in_features).to(dtype)


def quantize_groups(weight: torch.Tensor) -> Int4Grid:
    """`weight` [out, in] on the grid that fits each group best: levels int32, float32 scales and minimums.
    Rows are widened QUANTIZED_ROWS at a time (int8_linear.quantize_rows says why)."""
    out_features, in_features = weight.shape
    levels = torch.empty(weight.shape, dtype=torch.int32, device=weight.device)
    scale = torch.empty(out_features, in_features // GROUP_SIZE, device=weight.device)
    minimum = torch.empty_like(scale)
    if weight.is_meta:  # a model built empty: the shapes are all there is to know
        return Int4Grid(levels, scale, minimum)
    for start in range(0, out_features, QUANTIZED_ROWS):
        end = start + QUANTIZED_ROWS
        groups = weight[start:end].float().reshape(-1, in_features // GROUP_SIZE, GROUP_SIZE)  # [rows, groups, 32]
        low, high = groups.amin(dim=-1), groups.amax(dim=-1)
        scales = ((high - low) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
        q = torch.round((groups - low[..., None]) / scales[..., None]).clamp(0, LEVELS)
        levels[start:end], scale[start:end], minimum[start:end] = q.reshape(-1, in_features), scales, low
    return Int4Grid(levels, scale, minimum)


# Weights as a GGUF file holds them in blocks (Q4_0 and Q4_1 as an Int4Grid, Q8_0 as Int8Blocks): the layers
# quantized in the same form take them as they are.
Grid = Int4Grid | Int8Blocks


class GridLinear(torch.nn.Linear):
    """A linear layer whose weights are a GGUF file's blocks, read as they are, on its way to a quantized layer,
    which takes the grid itself where it is its own form (int4_grid, int8_blocks): the weights are not rounded a
    second time.

    Its weight stays on the meta device: a layer no kernel takes is made values with as_values().
    """

    def __init__(self, grid: Grid, bias: torch.Tensor | None, dtype: torch.dtype) -> None:
        out_features, in_features = grid.levels.shape
        super().__init__(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
        if bias is not None:
            self.bias = torch.nn.Parameter(bias.to(dtype), requires_grad=False)
        self.grid = grid

    def as_values(self) -> torch.nn.Linear:
        """The same layer with its weights as values in its dtype."""
        linear = torch.nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(self.grid.dense(self.weight.dtype), requires_grad=False)
        linear.bias = self.bias
        return linear


def int4_grid(linear: torch.nn.Linear) -> Int4Grid:
    """The grid `linear`'s weights are quantized on: its own where it has one, else the best-fitting one."""
    if isinstance(linear, GridLinear) and isinstance(linear.grid, Int4Grid):
        return linear.grid
    return quantize_groups(_float_weight(linear))


def int8_blocks(linear: torch.nn.Linear) -> Int8Blocks:
    """`linear`'s weights as int8 blocks: its own where it came as such, else quantized as Q8_0 quantizes."""
    if isinstance(linear, GridLinear) and isinstance(linear.grid, Int8Blocks):
        return linear.grid
    return quantize_blocks(_float_weight(linear))


def _float_weight(linear: torch.nn.Linear) -> torch.Tensor:
    """W [out, in]: as held, or a grid's values in float32 (rounded once, by the quantization to come)."""
    return linear.grid.dense(torch.float32) if isinstance(linear, GridLinear) else linear.weight.detach()


class Int4Linear(PackedLinear):
    """y = x @ W.T + bias, W = q * scale + minimum per group of GROUP_SIZE inputs of an output row."""

    kernel_max_rows = INT4_KERNEL_MAX_ROWS
    weight_int4: torch.Tensor  # buffers, registered in __init__
    scales_and_zeros: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        layout = packed_layout()
        if layout is None:  # built only where fits_int4_kernel() said the layout is one this layer reads
            raise RuntimeError("this torch packs int4 weights in a layout Int4Linear cannot read")
        self.layout = layout
        q, scale, minimum = int4_grid(linear)
        scale, minimum = scale.float(), minimum.float()
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 1))
        # [groups, out, 2]: (scale, minimum + 8 * scale) per group and output row, as the kernel reads them.
        pairs = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", pairs.contiguous().to(linear.weight.dtype))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight_int4, GROUP_SIZE, self.scales_and_zeros)

    def levels(self) -> torch.Tensor:
        """The quantized weights q [out, in] (uint8, 0..15), read back from the kernel's packed layout."""
        return _unpack(self.weight_int4, self.layout, self.out_features, self.in_features)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        out_features, in_features, layout = self.out_features, self.in_features, self.layout
        weight = torch.empty(out_features // layout.block, layout.block, in_features, dtype=dtype)
        weight.copy_(_nibbles(self.weight_int4, layout, out_features, in_features).transpose(1, 2))  # the levels
        scale, zero = self.scales_and_zeros.to(dtype).unbind(dim=-1)  # [groups, out] each
        groups = weight.view(out_features, -1, GROUP_SIZE)  # [out, groups, 32]
        groups.mul_(scale.T[..., None]).add_((zero - 8 * scale).T[..., None])  # q * scale + minimum, in place
        return weight.view(out_features, in_features)


def _nibbles(packed: torch.Tensor, layout: PackedLayout, out_features: int, in_features: int) -> torch.Tensor:
    """The levels [out / block, in, block] (uint8) of the kernel's packed layout."""
    blocks = packed.view(out_features // layout.block, in_features, layout.block // 2)  # [out / block, in, block / 2]
    low, high = blocks & 15, blocks >> 4
    if layout.paired:
        return torch.stack([low, high], dim=-1).flatten(-2)  # rows 2j, 2j + 1 of byte j, in order
    return torch.cat([low, high], dim=-1)


def _unpack(packed: torch.Tensor, layout: PackedLayout, out_features: int, in_features: int) -> torch.Tensor:
    nibbles = _nibbles(packed, layout, out_features, in_features)
    return nibbles.transpose(1, 2).reshape(out_features, in_features)
