"""Model files cut short or damaged (an interrupted download or copy), refused with the file's name.

The libraries that read them fail deep inside on such files, with struct errors, numpy
reshape errors, safetensors' "header too large" or torch's "failed finding central
directory", none of which says which file is broken or what to do. These checks read
only headers, so they cost milliseconds.
"""

from __future__ import annotations

import struct
import tarfile
import zipfile
from pathlib import Path

from streamchat.errors import ModelAccessError
from streamchat.loading.weights import PICKLED_WEIGHTS, SAFETENSORS_WEIGHTS

_GGUF_REMEDY = "delete it and download it again"
_ZIP_START = b"PK\x03\x04"
# The PROTO opcode that begins every pickle of protocol 2 or later.
_PICKLE_START = b"\x80"


def ensure_complete_gguf(gguf: Path) -> None:
    """Refuse a GGUF file whose header cannot be read, or that ends before its last tensor does.

    Files that are no GGUF at all, or a GGUF version or tensor type transformers cannot
    read, pass: transformers' own message says so when it reads the config.
    """
    # transformers' reader, the one that loads the file; it parses the header alone.
    from transformers.integrations.gguf.reader import GgufHeader

    size = gguf.stat().st_size
    if size == 0:
        raise ModelAccessError(f"{gguf} is empty; {_GGUF_REMEDY}")
    try:
        header = GgufHeader.from_file(str(gguf))
    except struct.error as error:
        # A string, an array or the tensor table runs past the end of the file.
        raise ModelAccessError(
            f"{gguf} is truncated or corrupt: its {size:,} bytes end inside its header; {_GGUF_REMEDY}"
        ) from error
    except (UnicodeDecodeError, OverflowError) as error:
        raise ModelAccessError(f"{gguf} is corrupt: its header is garbled ({error}); {_GGUF_REMEDY}") from error
    except ValueError:
        return
    end = header.data_start + max((tensor.offset + tensor.nbytes for tensor in header.tensors), default=0)
    if size < end:
        raise ModelAccessError(
            f"{gguf} is truncated or corrupt: it has {size:,} bytes but its tensors end at byte {end:,}; {_GGUF_REMEDY}"
        )


def ensure_intact_weights(directory: Path, *, remedy: str) -> None:
    """Refuse the weight files transformers will load from `directory` if one is cut short or garbled.

    That is every model*.safetensors, or, without those, every pytorch_model*.bin.
    `remedy` says what to do about a bad file, such as "delete it and download the model again".
    """
    safetensors = sorted(directory.glob(SAFETENSORS_WEIGHTS))
    for weights in safetensors or sorted(directory.glob(PICKLED_WEIGHTS)):
        problem = _safetensors_problem(weights) if weights in safetensors else _pickle_problem(weights)
        if problem is not None:
            raise ModelAccessError(f"{weights} is truncated or corrupt: {problem}; {remedy}")


def _safetensors_problem(weights: Path) -> str | None:
    from safetensors import SafetensorError, safe_open

    try:
        # Opening reads and checks the header: every tensor must lie inside the file.
        with safe_open(str(weights), framework="pt"):
            return None
    except SafetensorError as error:
        return str(error).removeprefix("Error while deserializing header: ")


def _pickle_problem(weights: Path) -> str | None:
    # torch.save writes a zip archive, whose directory sits at the very end of the file;
    # torch before 1.6 wrote a bare pickle, which only unpickling can check.
    if zipfile.is_zipfile(weights):
        return None
    with weights.open("rb") as file:
        start = file.read(len(_ZIP_START))
    if start == _ZIP_START:
        return "its zip archive ends before its directory"
    if start.startswith(_PICKLE_START) or tarfile.is_tarfile(weights):
        return None
    return "it is neither a zip archive nor a pickle"
