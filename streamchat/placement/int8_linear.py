"""Int8Linear: a linear layer with int8 weights, one scale per output row, computed by aten's int8 kernel.

`torch.ops.aten._weight_int8pack_mm` multiplies float activations by int8 weights
without materialising a float copy of them: on CPU it reads a quarter of float32's
weight bytes, which is what decode time goes to. The quantization libraries do not
reach it cheaply in eager mode (see quantization.py), so this module calls it itself.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
# The kernel multiplies a few activation rows at a time: ideal for decoding, one conversation or
# a batch of them (streamchat.generation.batch), but slower than a float matrix product for long
# prompt chunks. Above this many rows the weights are widened instead. Widening reads and writes
# every weight each call: on 2 cores, the default model's 49152 x 576 output layer took 11 ms
# through the kernel at 8 rows, 40 ms at 32, and 166-172 ms widened at any of them.
KERNEL_MAX_ROWS = 32
# The kernel's bf16 path segfaults or returns wrong sums unless in_features is a multiple of 16
# (torch 2.13 on AVX-512/AMX CPUs; fp16 and fp32 take any width): such layers stay as they are.
IN_FEATURES_MULTIPLE = 16


def fits_int8_kernel(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the int8 kernel computes correctly."""
    return linear.in_features % IN_FEATURES_MULTIPLE == 0


class Int8Linear(torch.nn.Module):
    """y = x @ (scales * weight_int8).T + bias, for activations in the dtype the layer was built from."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # [out, in]
        # Symmetric per output row: the row's largest magnitude maps to 127.
        scales = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [out]
        quantized = torch.round(weight / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.register_buffer("weight_int8", quantized.contiguous())
        # The kernel wants the scales in the activations' dtype.
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)  # [batch * seq, in]
        if rows.shape[0] <= KERNEL_MAX_ROWS:
            out = torch.ops.aten._weight_int8pack_mm(rows.contiguous(), self.weight_int8, self.scales)
        else:
            # A prompt chunk: one float product over the widened weights, as the unquantized layer did.
            out = rows @ (self.weight_int8.to(rows.dtype) * self.scales[:, None]).T
        out = out.reshape(*hidden.shape[:-1], self.out_features)  # [batch, seq, out]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
