from pathlib import Path

import torch

from streamchat.weights.packed_copy import packed_copy_path, read_packed_copy, write_packed_copy


class Packed(torch.nn.Module):
    def __init__(self, device: str = "cpu") -> None:
        super().__init__()
        self.register_buffer("levels", torch.arange(12, dtype=torch.uint8, device=device).view(3, 4))
        self.weight = torch.nn.Parameter(torch.linspace(0, 1, 5, device=device), requires_grad=False)


def test_a_copy_is_read_into_a_model_built_empty(tmp_path: Path):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")
    path = packed_copy_path(tmp_path, source, [source], "int4 bfloat16")
    write_packed_copy(Packed(), path)
    empty = Packed(device="meta")
    assert read_packed_copy(empty, path)
    assert torch.equal(empty.levels, Packed().levels) and torch.equal(empty.weight, Packed().weight)


def test_a_changed_file_or_layout_is_another_copy_and_a_new_copy_sweeps_the_old(tmp_path: Path):
    source, other = tmp_path / "model.gguf", tmp_path / "other.gguf"
    source.write_bytes(b"weights")
    other.write_bytes(b"weights")
    first = packed_copy_path(tmp_path, source, [source], "int4 bfloat16")
    assert packed_copy_path(tmp_path, source, [source], "int8 bfloat16") != first
    source.write_bytes(b"other weights")  # a new size and modification time
    second = packed_copy_path(tmp_path, source, [source], "int4 bfloat16")
    assert second != first
    assert second.parent == first.parent != packed_copy_path(tmp_path, other, [other], "int4 bfloat16").parent
    write_packed_copy(Packed(), first)
    write_packed_copy(Packed(), second)
    assert sorted(path.name for path in first.parent.iterdir()) == [second.name]


def test_a_copy_that_does_not_match_is_not_read(tmp_path: Path):
    path = tmp_path / "copy.safetensors"
    write_packed_copy(Packed(), path)
    other = torch.nn.Module()
    other.register_buffer("levels", torch.empty(3, 5, dtype=torch.uint8, device="meta"))
    assert not read_packed_copy(other, path)
    path.write_bytes(b"cut short")
    assert not read_packed_copy(Packed(device="meta"), path)
