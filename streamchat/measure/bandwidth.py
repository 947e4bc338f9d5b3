"""The memory-bandwidth limit of a decode step: the bytes it must read, over the bytes per second the device reads.

    limit_seconds = (weight_bytes_per_token(model) + kv_bytes_per_token(model, context, 2)) / measure_bandwidth(device)

A decode step of one token reads every weight once (all but the input embedding table,
of which it reads a row) and the keys and values of every cached token, so no decoder can
be faster than those bytes at the device's bandwidth, measured on the spot with one large
GEMV. llama.cpp's limit counts its GGUF file's tensors instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from streamchat.cache.quantized_kv import FULL, checked_format, model_token_bytes, token_bytes

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Bandwidth probe: a float32 matrix far larger than any CPU cache, read by one GEMV.
BANDWIDTH_PROBE_BYTES = 512 * 2**20
BANDWIDTH_PROBE_REPEATS = 5


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timer around GPU work needs it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second one large float32 GEMV reads on `device` (the best of a few)."""
    columns = 4096
    matrix = torch.rand(BANDWIDTH_PROBE_BYTES // 4 // columns, columns, device=device)
    vector = torch.rand(columns, device=device)
    best = float("inf")
    for _ in range(BANDWIDTH_PROBE_REPEATS):
        synchronize(device)
        started = time.perf_counter()
        torch.mv(matrix, vector)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return matrix.numel() * matrix.element_size() / best


def weight_bytes_per_token(model: PreTrainedModel) -> int:
    """Bytes of every parameter and buffer a decode step reads: all but the input embedding table.

    Quantized tensors count by their storage (their inner tensors), not by their float shape.
    """
    embedding = model.get_input_embeddings()
    output = model.get_output_embeddings()
    tied = output is not None and getattr(output, "weight", None) is embedding.weight
    # The table a step reads a row of (its weights, and a packed one's scales), unless the head reads it whole.
    table = set() if tied else {id(tensor) for tensor in [*embedding.parameters(), *embedding.buffers()]}
    total = 0
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or id(tensor) in table:
            continue
        seen.add(id(tensor))
        total += _storage_bytes(tensor)
    return total


def _storage_bytes(tensor: torch.Tensor) -> int:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(_storage_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)


def kv_bytes_per_token(model: PreTrainedModel, context: int, element_bytes: int) -> int:
    """Bytes of keys and values one decode step reads over `context` cached tokens, `element_bytes` a value."""
    return token_bytes(model.config, FULL, element_bytes) * context


def cache_bytes_per_token(model: PreTrainedModel, context: int, kv_format: str) -> int:
    """kv_bytes_per_token of a sink cache for `model` in `kv_format` (--kv-cache as settled): the model's dtype,
    or int8 with a float32 scale a token and head (its few sinks' exact copies aside)."""
    return model_token_bytes(model, checked_format(kv_format)) * context


def gguf_bytes_per_token(gguf: Path) -> int:
    """Bytes of a GGUF file's tensors: llama.cpp reads all of them per token (a tied output reads the table)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(gguf).tensors)
