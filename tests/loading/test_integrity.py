import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamchat.errors import ModelAccessError
from streamchat.loading.integrity import ensure_complete_gguf, ensure_intact_weights
from tests.support.gguf_files import write_tiny_gguf

REMEDY = "delete it and download the model again"


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def cut(data: bytes, length: int, path: Path) -> Path:
    path.write_bytes(data[:length])
    return path


def test_a_whole_gguf_passes(gguf_bytes: bytes, tmp_path: Path):
    ensure_complete_gguf(cut(gguf_bytes, len(gguf_bytes), tmp_path / "whole.gguf"))


@pytest.mark.parametrize("length", [30, 1000, 4000])
def test_a_gguf_cut_inside_its_header_is_refused(gguf_bytes: bytes, tmp_path: Path, length: int):
    gguf = cut(gguf_bytes, length, tmp_path / "cut.gguf")
    with pytest.raises(ModelAccessError) as raised:
        ensure_complete_gguf(gguf)
    assert str(raised.value) == (
        f"{gguf} is truncated or corrupt: its {length:,} bytes end inside its header; delete it and download it again"
    )
    assert raised.value.exit_code == 4


@pytest.mark.parametrize("missing", [1, 100, 10_000])
def test_a_gguf_cut_inside_its_tensors_is_refused(gguf_bytes: bytes, tmp_path: Path, missing: int):
    length = len(gguf_bytes) - missing
    gguf = cut(gguf_bytes, length, tmp_path / "cut.gguf")
    with pytest.raises(ModelAccessError) as raised:
        ensure_complete_gguf(gguf)
    assert str(raised.value) == (
        f"{gguf} is truncated or corrupt: it has {length:,} bytes but its tensors end at byte "
        f"{len(gguf_bytes):,}; delete it and download it again"
    )


def test_an_empty_gguf_is_refused(tmp_path: Path):
    gguf = cut(b"", 0, tmp_path / "empty.gguf")
    with pytest.raises(ModelAccessError, match=r"empty\.gguf is empty; delete it and download it again$"):
        ensure_complete_gguf(gguf)


def test_a_file_that_is_no_gguf_is_left_to_transformers_to_word(tmp_path: Path):
    ensure_complete_gguf(cut(b"not a gguf file at all", 22, tmp_path / "fake.gguf"))


@pytest.fixture(scope="module")
def weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("weights")
    save_file({"a": torch.arange(64.0), "b": torch.ones(8, 8)}, directory / "model.safetensors")
    return directory / "model.safetensors"


def test_whole_safetensors_pass(weights: Path):
    ensure_intact_weights(weights.parent, remedy=REMEDY)


@pytest.mark.parametrize(
    ("keep", "problem"),
    [
        (0, "header too small"),
        (100, "invalid header length"),
        (-1, "incomplete metadata, file not fully covered"),
    ],
)
def test_cut_safetensors_are_refused_by_name(weights: Path, tmp_path: Path, keep: int, problem: str):
    data = weights.read_bytes()
    broken = tmp_path / "model-00002-of-00002.safetensors"
    broken.write_bytes(data[:keep])
    shutil.copy(weights, tmp_path / "model-00001-of-00002.safetensors")
    with pytest.raises(ModelAccessError) as raised:
        ensure_intact_weights(tmp_path, remedy=REMEDY)
    assert str(raised.value) == f"{broken} is truncated or corrupt: {problem}; {REMEDY}"


def test_garbage_safetensors_are_refused(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ModelAccessError, match=r"model\.safetensors is truncated or corrupt: header too large;"):
        ensure_intact_weights(tmp_path, remedy=REMEDY)


@pytest.fixture(scope="module")
def pickled(weights: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("pickled") / "pytorch_model.bin"
    torch.save(load_file(weights), path)
    return path.read_bytes()


def test_pickled_weights_in_either_torch_format_pass(weights: Path, pickled: bytes, tmp_path: Path):
    (tmp_path / "pytorch_model.bin").write_bytes(pickled)
    ensure_intact_weights(tmp_path, remedy=REMEDY)
    torch.save(load_file(weights), tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    ensure_intact_weights(tmp_path, remedy=REMEDY)


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        (lambda whole: whole[: len(whole) // 2], "its zip archive ends before its directory"),
        (lambda whole: b"<html>rate limited</html>", "it is neither a zip archive nor a pickle"),
    ],
)
def test_damaged_pickled_weights_are_refused(
    pickled: bytes, tmp_path: Path, data: Callable[[bytes], bytes], problem: str
):
    broken = tmp_path / "pytorch_model.bin"
    broken.write_bytes(data(pickled))
    with pytest.raises(ModelAccessError) as raised:
        ensure_intact_weights(tmp_path, remedy=REMEDY)
    assert str(raised.value) == f"{broken} is truncated or corrupt: {problem}; {REMEDY}"


def test_pickled_weights_beside_safetensors_are_not_looked_at(weights: Path, tmp_path: Path):
    shutil.copy(weights, tmp_path / "model.safetensors")
    (tmp_path / "pytorch_model.bin").write_bytes(b"unused, and broken")
    ensure_intact_weights(tmp_path, remedy=REMEDY)
