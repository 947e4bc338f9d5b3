"""PackedLinear: what the int8 and int4 linear layers share, a product kernel for few rows and widened weights for many.

aten's weight-only kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) read the
packed weights without a float copy, which is what decode time goes to. They scale with
rows (the weights are reread for every few), yet at 32 rows their half-precision paths
still beat widening the weights for one float product, which reads and writes every
weight each call (measured on the default model's layers, README, Benchmarks). Above a
layer's kernel_max_rows (prompt chunks: KERNEL_MAX_ROWS, int4's own in int4_linear.py) the
weights are widened.

Their float32 paths are not vectorized on AVX2 CPUs (576 -> 1536 for one row: 0.45 ms,
against 0.14 ms for a plain float32 product and 0.08 ms in bfloat16): so `--quantize auto`
quantizes only models that compute in half precision (placement/quantization.py).
"""

from __future__ import annotations

import torch

KERNEL_MAX_ROWS = 32


class PackedLinear(torch.nn.Module):
    """y = x @ W.T + bias, W stored packed: subclasses give the kernel's product and the widened W."""

    kernel_max_rows = KERNEL_MAX_ROWS  # more rows than this: widened weights

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [n, in] (contiguous) @ W.T through the kernel: [n, out]."""
        raise NotImplementedError

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        """W [out, in] in `dtype`."""
        raise NotImplementedError

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)  # [batch * seq, in]
        few = rows.shape[0] <= self.kernel_max_rows
        out = self.product(rows.contiguous()) if few else rows @ self.widened(rows.dtype).T
        out = out.reshape(*hidden.shape[:-1], self.out_features)  # [batch, seq, out]
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
