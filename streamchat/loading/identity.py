"""Which weights exactly: a fingerprint of a loaded model, for the cache states that only those weights can use.

A saved cache holds keys and values the model computed: another model, or the same one
with other weights, a dtype or a quantization, computes others. The fingerprint reads
no weights (a 7B model would take seconds), only what tells them apart cheaply:

- the model's config.json and generation_config.json;
- the weights' index (model.safetensors.index.json) where there is one, and each
  safetensors file's header (every tensor's name, dtype, shape and offsets) and size;
- the loaded model's layout: every parameter's and buffer's name, dtype and shape, and
  the classes of its modules, which any quantization changes.

The directory's path is part of it too: a hub snapshot's path names its commit, and a
local model moved elsewhere is, for all streamchat knows, another model.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path
from typing import Any

_DESCRIBING_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json")
# A safetensors file starts with the length of its JSON header, a little-endian u64.
_HEADER_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 100_000_000  # safetensors' own limit


def weights_fingerprint(directory: Path, model: Any) -> str:
    """A hex digest that changes whenever the weights in `directory`, or how `model` holds them, change."""
    digest = hashlib.sha256()
    digest.update(str(directory.resolve()).encode("utf-8"))
    for name in _DESCRIBING_FILES:
        path = directory / name
        if path.is_file():
            digest.update(name.encode("utf-8") + b"\0" + path.read_bytes())
    for path in sorted(directory.glob("*.safetensors")):
        digest.update(f"{path.name}\0{path.stat().st_size}\0".encode())
        digest.update(_safetensors_header(path))
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
    for module_class in sorted({type(module).__qualname__ for module in model.modules()}):
        digest.update(module_class.encode("utf-8") + b"\0")
    return digest.hexdigest()


def quantization_of(model: Any) -> str:
    """How the weights are quantized, as transformers records it on the config; "none" when they are not."""
    config = getattr(model, "config", None)
    quantization = getattr(config, "quantization_config", None)
    if quantization is None:
        return "none"
    method = quantization.get("quant_method") if isinstance(quantization, dict) else None
    method = method or getattr(quantization, "quant_method", None)
    return str(getattr(method, "value", method) or type(quantization).__name__)


def _safetensors_header(path: Path) -> bytes:
    try:
        with path.open("rb") as file:
            (length,) = _HEADER_LENGTH.unpack(file.read(_HEADER_LENGTH.size))
            return file.read(min(length, _MAX_HEADER))
    except (OSError, struct.error):
        return b""  # unreadable: loading it would have failed first; the size above still counts
