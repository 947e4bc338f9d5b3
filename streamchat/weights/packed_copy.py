"""The packed copy: a model's weights in the form they run in (quantized, packed), written once, read at later starts.

Quantizing and packing a model from its files takes a while (a minute or more for a 7B on
two cores); the packed weights are about a quarter of bfloat16's bytes. The first start writes
them, in safetensors, under a name hashed from the source files' fingerprint (path, size,
modification time) and the layout they were packed for (quantization, dtype, kernels, torch,
FORMAT); a later start builds the model empty in that layout (its quantized layers made on the
meta device, so they cost nothing) and assigns the tensors read from the copy.

Layout under the directory the loader gives:

    <source stem>-<hash of its path>/<hash of its fingerprint and layout>.safetensors

A copy appears whole or not at all (written beside, then renamed); a newer copy of the same
source sweeps away the older ones.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path
from typing import BinaryIO

import torch

from streamchat.errors import StreamchatError

# Changes whenever the packed layers' tensors change meaning: older copies are then not read.
FORMAT = "streamchat-packed-3"  # 2: the input embedding in int8 blocks; 3: int8 layers in blocks too
SUFFIX = ".safetensors"
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def packed_copy_path(root: Path, source_path: Path, files: list[Path], layout: str) -> Path:
    """Where the packed copy of the model at `source_path` (a GGUF file or a directory), read from `files`, lives
    in `layout`. Each file counts by its path, size and modification time: reading them whole to hash them
    would cost a 7B model's start seconds, to guard against a rewrite that keeps both."""
    path_digest = hashlib.sha256(str(source_path.resolve()).encode()).hexdigest()[:12]
    stats = [(str(path.resolve()), path.stat().st_size, path.stat().st_mtime_ns) for path in sorted(files)]
    digest = hashlib.sha256(f"{FORMAT}\0{stats}\0{layout}".encode()).hexdigest()[:24]
    return root / f"{source_path.stem}-{path_digest}" / f"{digest}{SUFFIX}"


def write_packed_copy(model: torch.nn.Module, path: Path) -> None:
    """Write `model`'s tensors to `path` atomically, and remove older copies of the same source.

    A copy that cannot be written (a full or read-only disk) is no error: the model runs, and the
    next start packs it again.
    """
    tensors = model.state_dict()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(prefix=".partial-", suffix=SUFFIX, dir=path.parent)
        try:
            with os.fdopen(handle, "wb") as file:
                _write_safetensors(file, tensors)
            os.replace(partial, path)
        finally:
            Path(partial).unlink(missing_ok=True)
    except OSError:
        return
    for sibling in path.parent.glob(f"*{SUFFIX}"):
        if sibling != path:
            sibling.unlink(missing_ok=True)


def _write_safetensors(file: BinaryIO, tensors: dict[str, torch.Tensor]) -> None:
    """`tensors` in the safetensors format, a tensor at a time: safetensors' own save_file builds the whole
    file in memory first, which would double a 7B model's packed weights (4.7 GB) at the end of its load."""
    header: dict[str, object] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[tensor.dtype], "shape": list(tensor.shape)}
        header[name]["data_offsets"] = [offset, offset + size]  # type: ignore[index]  # a dict, made above
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts aligned, as safetensors writes it
    file.write(struct.pack("<Q", len(encoded)) + encoded)
    for tensor in tensors.values():
        file.write(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy().data)


def read_packed_copy(model: torch.nn.Module, path: Path) -> bool:
    """Assign the tensors of the packed copy at `path` to `model` (built empty in the copy's layout).

    False, with `model` untouched, where the copy is unreadable or does not match the model's tensors:
    the caller packs the model again.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(path)
    except (OSError, SafetensorError):
        return False
    expected = model.state_dict()
    if tensors.keys() != expected.keys() or any(
        (tensors[name].dtype, tensors[name].shape) != (tensor.dtype, tensor.shape) for name, tensor in expected.items()
    ):
        return False
    try:
        model.load_state_dict(tensors, strict=True, assign=True)
    except RuntimeError as error:
        raise StreamchatError(f"the packed copy {path} does not fit the model ({error}); delete it") from error
    return True
