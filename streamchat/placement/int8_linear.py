"""int8 weights: Int8Linear, a linear layer with one scale per output row, computed by aten's int8 kernel;
Int8Blocks, GGUF's Q8_0 layout (a scale per block of 32 inputs: native_layers.TiledInt8Linear computes it); and
BlockInt8Embedding, the input embedding in that layout.

`torch.ops.aten._weight_int8pack_mm` multiplies activations by int8 weights without
materialising a float copy of them: it reads half of bfloat16's weight bytes, which is
what decode time goes to. The quantization libraries do not reach it cheaply in eager
mode (see quantization.py), so this module calls it itself (placement/packed_linear.py:
when it runs the kernel and when it widens the weights instead).

The input embedding is only ever read a row per token, so it needs no kernel: a quantized
model keeps it as int8 blocks of 32 with a float16 scale each, Q8_0's layout, widened row by
row as tokens come in. That holds a GGUF's Q8_0 table exactly (quantizing its dequantized
values gives back its own bytes) at 1.06 bytes a weight instead of bfloat16's 2.
"""

from __future__ import annotations

from typing import NamedTuple, TypeGuard

import torch

from streamchat.placement.packed_linear import PackedLinear

INT8_MAX = 127
# The kernel's bf16 path segfaults or returns wrong sums unless in_features is a multiple of 16
# (torch 2.13 on AVX-512/AMX CPUs; fp16 and fp32 take any width): such layers stay as they are.
IN_FEATURES_MULTIPLE = 16
# Rows a quantization widens to float32 at a time (quantize_rows, int4_linear.quantize_groups).
QUANTIZED_ROWS = 1024
# How many of each row's best logits Int8Head recomputes in float32.
REFINED_CANDIDATES = 8
# Inputs of one row that share a scale in Int8Blocks: Q8_0's block.
INT8_BLOCK = 32


def fits_int8_kernel(linear: torch.nn.Linear) -> bool:
    """Whether `linear` has a shape the int8 kernel computes correctly."""
    return linear.in_features % IN_FEATURES_MULTIPLE == 0


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as int8 [out, in] and float32 scales [out]: symmetric per output row, the row's
    largest magnitude mapped to 127. Rows are quantized QUANTIZED_ROWS at a time: widened whole, a 49k-token
    output head would hold three float32 copies of itself at once (1.2 GB at 1.7B) while a model loads."""
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    if weight.is_meta:  # a model built empty: the shapes are all there is to know
        return quantized, scales
    for start in range(0, weight.shape[0], QUANTIZED_ROWS):
        wide = weight[start : start + QUANTIZED_ROWS].float()
        rows = wide.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / INT8_MAX  # [rows]
        quantized[start : start + QUANTIZED_ROWS] = torch.round(wide / rows[:, None]).clamp(-INT8_MAX, INT8_MAX)
        scales[start : start + QUANTIZED_ROWS] = rows
    return quantized, scales


class Int8Linear(PackedLinear):
    """y = x @ (scales * weight_int8).T + bias."""

    weight_int8: torch.Tensor  # buffers, registered in __init__
    scales: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__(linear)
        quantized, scales = quantize_rows(linear.weight.detach())
        self.register_buffer("weight_int8", quantized)
        # The kernel wants the scales in the activations' dtype.
        self.register_buffer("scales", scales.to(linear.weight.dtype))

    def product(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(rows, self.weight_int8, self.scales)

    def widened(self, dtype: torch.dtype) -> torch.Tensor:
        return self.weight_int8.to(dtype) * self.scales.to(dtype)[:, None]


class Int8Head(Int8Linear):
    """The output projection in int8: float32 logits, the best REFINED_CANDIDATES of each row computed in float32.

    In half precision the kernel rounds logits to 8 significant bits (0.125 apart at 25): coarser than
    a small model's margin between its best tokens. The default model's first token for "What is the
    capital of France?" leads by 0.08 in float32 ("The" over "L"); rounded, the two tied under int4
    weights and the greedy answer went to "L'Étoile". Recomputing the few best of each row exactly
    (their int8 rows, in float32) costs well under 1 % of a decode pass and lets greedy and the shortlist
    decide as float32 logits of the same hidden state would.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().forward(hidden)
        if logits.dtype == torch.float32:
            return logits
        rows = hidden.reshape(-1, self.in_features).float()  # [n, in]
        refined = logits.reshape(-1, self.out_features).float()  # [n, vocab]
        best = refined.topk(min(REFINED_CANDIDATES, self.out_features), dim=-1).indices  # [n, k]
        exact = torch.einsum("ni,nki->nk", rows, self.weight_int8[best].float()) * self.scales[best].float()
        if self.bias is not None:
            exact = exact + self.bias.float()[best]
        return refined.scatter_(-1, best, exact).reshape(*logits.shape[:-1], self.out_features)


class Int8Blocks(NamedTuple):
    """Weights as int8 levels, each block of INT8_BLOCK inputs of a row with its own float16 scale: w = scale *
    level. GGUF's Q8_0 blocks are such blocks."""

    levels: torch.Tensor  # [rows, columns] int8
    scale: torch.Tensor  # [rows, columns / INT8_BLOCK] float16

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """W [rows, columns] in `dtype`, each product computed in float32 (as gguf-py dequantizes Q8_0)."""
        rows, columns = self.levels.shape
        blocks = self.levels.view(rows, -1, INT8_BLOCK).float() * self.scale.float()[..., None]  # [rows, blocks, 32]
        return blocks.view(rows, columns).to(dtype)


def quantize_blocks(weight: torch.Tensor) -> Int8Blocks:
    """`weight` [rows, columns] as int8 blocks (float16 scales [rows, columns / INT8_BLOCK]), as GGUF's Q8_0
    quantizes (each block's largest magnitude mapped to 127, the values scaled by the inverse of the
    unrounded scale), QUANTIZED_ROWS rows at a time."""
    rows, columns = weight.shape
    quantized = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(rows, columns // INT8_BLOCK, dtype=torch.float16, device=weight.device)
    if weight.is_meta:
        return Int8Blocks(quantized, scales)
    for start in range(0, rows, QUANTIZED_ROWS):
        wide = weight[start : start + QUANTIZED_ROWS].float()
        blocks = wide.reshape(wide.shape[0], -1, INT8_BLOCK)  # [rows, blocks, 32]
        scale = blocks.abs().amax(dim=-1) / INT8_MAX  # [rows, blocks]
        inverse = torch.where(scale == 0, 0.0, 1 / scale)
        quantized[start : start + QUANTIZED_ROWS] = torch.round(blocks * inverse[..., None]).reshape(wide.shape)
        scales[start : start + QUANTIZED_ROWS] = scale.half()
    return Int8Blocks(quantized, scales)


def fits_block_embedding(embedding: torch.nn.Module) -> TypeGuard[torch.nn.Embedding]:
    """Whether `embedding` is a plain embedding table whose rows split into whole blocks."""
    return type(embedding) is torch.nn.Embedding and embedding.embedding_dim % INT8_BLOCK == 0


class BlockInt8Embedding(torch.nn.Module):
    """An embedding table as int8 blocks of INT8_BLOCK inputs with a float16 scale each; a looked-up row is
    widened in float32 (d * q, as gguf-py dequantizes Q8_0) and handed on in the model's dtype."""

    weight: torch.Tensor  # buffers, registered in __init__: [vocab, dim] int8
    scales: torch.Tensor  # [vocab, dim / INT8_BLOCK] float16

    def __init__(self, embedding: torch.nn.Embedding) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx
        self.dtype = embedding.weight.dtype  # what the rows are handed on in
        quantized, scales = quantize_blocks(embedding.weight.detach())
        self.register_buffer("weight", quantized)
        self.register_buffer("scales", scales)
        self._widened: tuple[torch.Tensor, torch.Tensor] | None = None  # (the scales, them in float32)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # int8 levels times float32 scales multiply in float32 (type promotion), in one operation: a decode step
        # looks up one row, where each operation's dispatch costs more than its arithmetic.
        levels = self.weight[input_ids].view(*input_ids.shape, -1, INT8_BLOCK)  # [..., blocks, 32]
        rows = torch.mul(levels, self._wide_scales()[input_ids].unsqueeze(-1))
        return rows.view(*input_ids.shape, self.embedding_dim).to(self.dtype)  # [..., dim]

    def _wide_scales(self) -> torch.Tensor:
        """The scales in float32, widened once from the float16 ones held (and written to a packed copy)."""
        if self._widened is None or self._widened[0] is not self.scales:
            self._widened = (self.scales, self.scales.float())
        return self._widened[1]

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 blocks of {INT8_BLOCK}"
