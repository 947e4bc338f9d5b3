from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from transformers import AutoConfig

from streamchat.placement.int4_linear import Int4Grid
from streamchat.placement.int8_linear import Int8Blocks
from streamchat.weights.filling import empty_model
from streamchat.weights.gguf_source import GgufSource, holds_int8_blocks
from tests.support.gguf_files import write_tiny_gguf

Q = gguf.GGMLQuantizationType


def source_of(path: Path) -> GgufSource:
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    return GgufSource(path, empty_model(config, torch.float32, "sdpa"))


def file_values(path: Path, gguf_name: str) -> np.ndarray:
    """gguf-py's own dequantization of a tensor, in the file's row order."""
    tensor = next(tensor for tensor in gguf.GGUFReader(path).tensors if tensor.name == gguf_name)
    return dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape.tolist())))


def processed_values(path: Path, gguf_name: str) -> np.ndarray:
    """file_values as transformers' llama processing orders them: the rows llama.cpp interleaved for its rotary
    layout put back."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict()
    return LlamaTensorProcessor(config).process(weights=file_values(path, gguf_name), name=gguf_name).weights


@pytest.mark.parametrize("matrix_type", [Q.Q4_0, Q.Q4_1])
def test_q4_blocks_come_as_their_grid_value_for_value(tmp_path: Path, matrix_type: Q):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=matrix_type)
    source = source_of(path)
    grid = source.read("model.layers.0.mlp.down_proj.weight")

    assert isinstance(grid, Int4Grid)
    assert (grid.levels.dtype, grid.scale.dtype, grid.minimum.dtype) == (torch.uint8, torch.float16, torch.float16)
    assert int(grid.levels.max()) <= 15
    assert np.array_equal(grid.dense(torch.float32).numpy(), file_values(path, "blk.0.ffn_down.weight"))


def test_query_and_key_grids_are_permuted_as_transformers_permutes_their_values(tmp_path: Path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=Q.Q4_0)
    grid = source_of(path).read("model.layers.1.self_attn.k_proj.weight")
    expected = processed_values(path, "blk.1.attn_k.weight")
    assert not np.array_equal(expected, file_values(path, "blk.1.attn_k.weight"))
    assert np.array_equal(grid.dense(torch.float32).numpy(), expected)


def test_q8_0_blocks_come_as_int8_blocks_value_for_value(tmp_path: Path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=Q.Q8_0)
    blocks = source_of(path).read("model.layers.0.mlp.down_proj.weight")

    assert isinstance(blocks, Int8Blocks)
    assert (blocks.levels.dtype, blocks.scale.dtype) == (torch.int8, torch.float16)
    assert np.array_equal(blocks.dense(torch.float32).numpy(), file_values(path, "blk.0.ffn_down.weight"))
    # Query and key rows permuted as transformers permutes their values, as a grid's are.
    keys = source_of(path).read("model.layers.1.self_attn.k_proj.weight")
    assert isinstance(keys, Int8Blocks)
    assert np.array_equal(keys.dense(torch.float32).numpy(), processed_values(path, "blk.1.attn_k.weight"))


def test_a_file_mostly_in_q8_0_holds_int8_blocks(tmp_path: Path):
    assert holds_int8_blocks(write_tiny_gguf(tmp_path / "q8.gguf", matrix_type=Q.Q8_0))
    assert not holds_int8_blocks(write_tiny_gguf(tmp_path / "q4.gguf", matrix_type=Q.Q4_0))
    (tmp_path / "broken.gguf").write_bytes(b"GGUF")  # its header cannot be read: loading it says why
    assert not holds_int8_blocks(tmp_path / "broken.gguf")


@pytest.mark.parametrize("matrix_type", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_other_blocks_are_dequantized_as_gguf_py_dequantizes_them(tmp_path: Path, matrix_type: Q):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", matrix_type=matrix_type, hidden_size=256)
    values = source_of(path).read("model.layers.0.mlp.up_proj.weight")

    assert isinstance(values, torch.Tensor)
    assert values.dtype == torch.float32
    assert np.array_equal(values.numpy(), file_values(path, "blk.0.ffn_up.weight"))
    assert bool(torch.isfinite(values).all())  # sane scales: no infinities or NaNs from garbage


def test_float_tensors_are_read_as_stored(tmp_path: Path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    norm = source_of(path).read("model.norm.weight")
    assert np.array_equal(norm.numpy(), file_values(path, "output_norm.weight"))
