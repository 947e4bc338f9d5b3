"""Int8Linear: a linear layer with int8 weights, one scale per output row, computed by aten's int8 kernel.

`torch.ops.aten._weight_int8pack_mm` multiplies activations by int8 weights without
materialising a float copy of them: it reads half of bfloat16's weight bytes, which is
what decode time goes to. The quantization libraries do not reach it cheaply in eager
mode (see quantization.py), so this module calls it itself (placement/packed_linear.py:
when it runs the kernel and when it widens the weights instead).
"""

from __future__ import annotations

import torch

from streamchat.placement.packed_linear import PackedLinear

INT8_MAX = 127
# The kernel's bf16 path segfaults or returns wrong sums unless in_features is a multiple of 16
# (torch 2.13 on AVX-512/AMX CPUs; fp16 and fp32 take any width): such layers stay as they are.
IN_FEATURES_MULTIPLE = 16


def fits_int8_kernel(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the int8 kernel computes correctly."""
    return linear.in_features % IN_FEATURES_MULTIPLE == 0


class Int8Linear(PackedLinear):
    """y = x @ (scales * weight_int8).T + bias."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        weight = linear.weight.detach().float()  # [out, in]
        # Symmetric per output row: the row's largest magnitude maps to 127.
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [out]
        quantized = torch.round(weight / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.register_buffer("weight_int8", quantized.contiguous())
        # The kernel wants the scales in the activations' dtype.
        self.register_buffer("scales", scales.to(linear.weight.dtype))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]
