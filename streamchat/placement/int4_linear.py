"""Int4Linear: a linear layer with 4-bit weights in groups, computed by aten's CPU int4 kernel.

`torch.ops.aten._weight_int4pack_mm_for_cpu` dequantizes in registers: for one activation
row it reads half the bytes of the int8 kernel (single-thread on an AVX-512 CPU: 60 us against
205 us for 576 -> 1536, shared/notes/performance.md).
torchao reaches the same kernel through a tensor subclass whose dispatch costs tens of
microseconds per call, which on a small model ate the gain (211 products a token), so
this module calls the kernel itself, as Int8Linear does for int8 (placement/packed_linear.py:
when it runs the kernel and when it widens the weights instead).

Each group of GROUP_SIZE inputs of an output row keeps its own minimum and step (the
GGUF Q4_1 scheme, whose blocks are 32 wide: weights that came from a Q4_1 file come back
on the same grid): w = q * step + minimum, q in 0..15. The kernel takes the pair as
(step, minimum + 8 * step), in the activations' dtype.
"""

from __future__ import annotations

import functools

import torch

from streamchat.placement.packed_linear import PackedLinear

GROUP_SIZE = 32
LEVELS = 15  # q in 0..15
# The kernel's packed layout holds 32 output rows a block: [out / 32, in, 16] bytes, row j of a
# block in the low nibbles and row 16 + j in the high ones. Prompt chunks widen the weights from
# it, so layers whose outputs are not whole blocks stay as they are.
OUT_BLOCK = 32


def fits_int4_kernel(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the int4 kernel takes, in the packed layout this module reads."""
    shaped = linear.in_features % GROUP_SIZE == 0 and linear.out_features % OUT_BLOCK == 0
    return shaped and packed_layout_is_known()


@functools.cache
def packed_layout_is_known() -> bool:
    """Whether this torch packs int4 weights as levels() reads them (checked once, on a small probe)."""
    probe = torch.arange(OUT_BLOCK * 2 * GROUP_SIZE, dtype=torch.int32).reshape(OUT_BLOCK * 2, GROUP_SIZE) % 16
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 1)
    return packed.numel() * 2 == probe.numel() and torch.equal(_unpack(packed, *probe.shape), probe.to(torch.uint8))


def quantize_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as (q int32 [out, in], step [out, groups], minimum [out, groups]), float32 params."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)  # [out, groups, 32]
    minimum, maximum = groups.amin(dim=-1), groups.amax(dim=-1)
    step = ((maximum - minimum) / LEVELS).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round((groups - minimum[..., None]) / step[..., None]).clamp(0, LEVELS)
    return q.reshape(out_features, in_features).to(torch.int32), step, minimum


class Int4Linear(PackedLinear):
    """y = x @ W.T + bias, W = q * step + minimum per group of GROUP_SIZE inputs of an output row."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        q, step, minimum = quantize_groups(linear.weight.detach())
        self.register_buffer("weight_int4", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        # [groups, out, 2]: (step, minimum + 8 * step) per group and output row, as the kernel reads them.
        pairs = torch.stack([step, minimum + 8 * step], dim=-1).transpose(0, 1)
        self.register_buffer("scales_and_zeros", pairs.contiguous().to(linear.weight.dtype))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.weight_int4, GROUP_SIZE, self.scales_and_zeros)

    def levels(self) -> torch.Tensor:
        """The quantized weights q [out, in] (uint8, 0..15), read back from the kernel's packed layout."""
        return _unpack(self.weight_int4, self.out_features, self.in_features)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        out_features, in_features = self.out_features, self.in_features
        weight = torch.empty(out_features // OUT_BLOCK, OUT_BLOCK, in_features, dtype=dtype)
        weight.copy_(_nibbles(self.weight_int4, out_features, in_features).transpose(1, 2))  # the levels, widened
        step, zero = self.scales_and_zeros.to(dtype).unbind(dim=-1)  # [groups, out] each
        groups = weight.view(out_features, -1, GROUP_SIZE)  # [out, groups, 32]
        groups.mul_(step.T[..., None]).add_((zero - 8 * step).T[..., None])  # q * step + minimum, in place
        return weight.view(out_features, in_features)


def _nibbles(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The levels [out / 32, in, 32] (uint8) of the kernel's packed layout."""
    blocks = packed.view(out_features // OUT_BLOCK, in_features, OUT_BLOCK // 2)  # [out / 32, in, 16] bytes
    return torch.cat([blocks & 15, blocks >> 4], dim=-1)


def _unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    return _nibbles(packed, out_features, in_features).transpose(1, 2).reshape(out_features, in_features)
