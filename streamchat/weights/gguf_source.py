"""A GGUF file's tensors under the model's parameter names, read a tensor at a time (no map kept: sources.py).

Q4_0 and Q4_1 blocks come back as an Int4Grid, as they are: a block is a group of 32 inputs of
one output row with its own scale and minimum (Q4_1: d and m; Q4_0: d and -8 d), which is
streamchat's int4 format, so no value is rounded twice. Q8_0 blocks come back as Int8Blocks (d and
32 int8 levels), streamchat's int8 format. Every other type (the K-quants, the float types) is
dequantized as gguf-py dequantizes it, a tensor at a time.

transformers supplies what is not about values: the name map from llama.cpp's tensor names
to the model's (gguf-py's tables), and the per-architecture undoing of llama.cpp's layout
changes (the query and key rows llama.cpp permutes, for one). A grid's rows are permuted the
way those rows are; an architecture whose processing is more than a row permutation gets
dequantized values instead.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamchat.errors import ModelAccessError
from streamchat.placement.fusion import unfused_names
from streamchat.placement.int4_linear import GROUP_SIZE, Int4Grid
from streamchat.placement.int8_linear import INT8_BLOCK, Int8Blocks
from streamchat.weights.sources import SourceTensor

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# ggml's type ids (gguf.GGMLQuantizationType) of the types read as values without dequantizing.
_FLOATS = {0: np.float32, 1: np.float16}
_BF16 = 30
_Q4_0, _Q4_1, _Q8_0 = 2, 3, 8
# Bytes before a block's levels: d (float16), and for Q4_1 m (float16); Q4 blocks hold 16 bytes of levels, Q8_0 32.
_GRID_HEADER = {_Q4_0: 2, _Q4_1: 4, _Q8_0: 2}


class GgufSource:
    """The tensors of `path` by the parameter names of `model` (built empty, fused or not: only its names are read)."""

    def __init__(self, path: Path, model: PreTrainedModel) -> None:
        from transformers.integrations.gguf.reader import GgufHeader
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            LlamaTensorProcessor,
            TensorProcessor,
        )

        self.path = path
        try:
            header = GgufHeader.from_file(str(path))
        except (OSError, ValueError) as error:
            raise ModelAccessError(f"cannot read {path}: {error}") from error
        self._data_start = header.data_start
        self._infos = {info.name: info for info in header.tensors}
        config = model.config.get_text_config(decoder=True).to_dict()
        self._processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=config)
        # Grids are read as they are only where the processing is a row permutation (or nothing).
        self._grids_readable = type(self._processor) in (TensorProcessor, LlamaTensorProcessor)
        self._gguf_name = _gguf_names(model, header.architecture, set(self._infos))

    def names(self) -> Iterable[str]:
        return self._gguf_name.keys()

    def read(self, name: str) -> SourceTensor:
        gguf_name = self._gguf_name[name]
        info = self._infos[gguf_name]
        data = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=self._data_start + info.offset)
        if info.ggml_type in _GRID_HEADER and self._grids_readable and len(info.shape) == 2:
            rows, columns = info.shape
            grid = (
                _int8_blocks(data, rows, columns)
                if info.ggml_type == _Q8_0
                else _grid(data, info.ggml_type, rows, columns)
            )
            order = self._row_order(gguf_name, info.shape[0])
            return grid if order is None else type(grid)(*(part[order] for part in grid))
        values = self._processed(gguf_name, _values(data, info.ggml_type, info.shape))
        return torch.from_numpy(np.ascontiguousarray(values))

    def _processed(self, gguf_name: str, values: np.ndarray) -> np.ndarray:
        return self._processor.process(
            weights=values, name=gguf_name, tensor_key_mapping={}, parsed_parameters={}
        ).weights

    def _row_order(self, gguf_name: str, rows: int) -> torch.Tensor | None:
        """The order the processing puts the rows of `gguf_name` in; None where it keeps them as they are."""
        order = np.asarray(self._processed(gguf_name, np.arange(rows).reshape(rows, 1))).reshape(-1)
        if np.array_equal(order, np.arange(rows)):
            return None
        return torch.from_numpy(order.astype(np.int64))


def _gguf_names(model: PreTrainedModel, architecture: str, held: set[str]) -> dict[str, str]:
    """The file's name for each of `model`'s tensors that it holds, by gguf-py's tables for `architecture`."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise ModelAccessError(f"gguf {_gguf_version()} does not know the GGUF architecture {architecture!r}")
    config = model.config.get_text_config(decoder=True)
    table = get_tensor_name_map(arch, config.num_hidden_layers)  # built once: it takes a moment
    names = {}
    for name in (part for fused in model.state_dict() for part in unfused_names(fused)):
        base, dot, suffix = name.rpartition(".")
        gguf_base = table.get_name(base) if dot else None
        if gguf_base is not None and f"{gguf_base}.{suffix}" in held:
            names[name] = f"{gguf_base}.{suffix}"
    return names


def _gguf_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("gguf")


def _values(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's values (float32 for blocks, as gguf-py dequantizes them; floats as stored)."""
    if ggml_type in _FLOATS:
        return data.view(_FLOATS[ggml_type]).reshape(shape)
    if ggml_type == _BF16:  # numpy has no bfloat16: widened exactly, through the upper half of a float32
        return (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows = int(np.prod(shape[:-1]))
    # Every type id here is one transformers' reader knows (it refuses a file holding another), so gguf-py's too.
    return dequantize(data.reshape(rows, -1), GGMLQuantizationType(ggml_type)).reshape(shape)


def _grid(data: np.ndarray, ggml_type: int, rows: int, columns: int) -> Int4Grid:
    """Q4_0 or Q4_1 blocks [rows, columns / 32] as an Int4Grid, value for value."""
    header = _GRID_HEADER[ggml_type]
    blocks = data.reshape(rows, columns // GROUP_SIZE, header + GROUP_SIZE // 2)  # [rows, groups, block bytes]
    scale = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]  # [rows, groups]
    if ggml_type == _Q4_1:
        minimum = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    else:
        minimum = scale * np.float16(-8)  # exact: a power of two
    packed = blocks[..., header:]  # [rows, groups, 16]: input j in the low nibble of byte j, input 16 + j in the high
    levels = np.concatenate([packed & 15, packed >> 4], axis=-1).reshape(rows, columns)
    as_torch = (torch.from_numpy(np.ascontiguousarray(part)) for part in (levels, scale, minimum))
    return Int4Grid(*as_torch)


def _int8_blocks(data: np.ndarray, rows: int, columns: int) -> Int8Blocks:
    """Q8_0 blocks [rows, columns / 32] as Int8Blocks, value for value."""
    header = _GRID_HEADER[_Q8_0]
    blocks = data.reshape(rows, columns // INT8_BLOCK, header + INT8_BLOCK)  # [rows, blocks, block bytes]
    scale = np.ascontiguousarray(blocks[..., 0:header]).view(np.float16)[..., 0]  # [rows, blocks]
    levels = np.ascontiguousarray(blocks[..., header:]).view(np.int8).reshape(rows, columns)
    return Int8Blocks(torch.from_numpy(levels), torch.from_numpy(scale))


def holds_int8_blocks(path: Path) -> bool:
    """Whether most of the GGUF file's decoder weights are Q8_0 blocks (False where its header cannot be read:
    loading it says why)."""
    from transformers.integrations.gguf.reader import GgufHeader

    try:
        header = GgufHeader.from_file(str(path))
    except (OSError, ValueError, struct.error):
        return False
    weights = [info for info in header.tensors if info.name.startswith("blk.") and len(info.shape) == 2]
    sizes = {info.name: int(np.prod(info.shape)) for info in weights}
    in_blocks = sum(sizes[info.name] for info in weights if info.ggml_type == _Q8_0)
    return 2 * in_blocks > sum(sizes.values())
