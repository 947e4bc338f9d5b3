"""Where a model's tensors come from, one at a time: the WeightSource protocol, and safetensors files.

A source names the tensors it holds by the model's own parameter names and reads each on
request, so a model is filled without the whole checkpoint in memory. Nothing stays mapped
between reads: pages of a mapped file count towards a process's resident memory for as long
as the mapping lives, and a 7B checkpoint read through one long-lived map would show 13.5 GB.
A tensor comes back as values (any float dtype: the filler converts it) or, from a GGUF's
Q4_0, Q4_1 and Q8_0 blocks, as a Grid that the quantized layers take without rounding again.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

import torch

from streamchat.errors import ModelAccessError
from streamchat.placement.int4_linear import Grid

SourceTensor = torch.Tensor | Grid
_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILES = "model*.safetensors"


class WeightSource(Protocol):
    """A checkpoint's tensors by the model's parameter names, read one at a time."""

    def names(self) -> Iterable[str]:
        """Every tensor the source holds."""
        ...

    def read(self, name: str) -> SourceTensor:
        """The tensor `name`, read now (the source keeps no copy)."""
        ...


class SafetensorsSource:
    """The model*.safetensors files of a model directory (sharded with an index, or one file)."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        self._where: dict[str, Path] = {}
        index = directory / _INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
            self._where = {name: directory / file for name, file in weight_map.items()}
        else:
            for path in sorted(directory.glob(SAFETENSORS_FILES)):
                with safe_open(path, framework="pt") as handle:
                    self._where |= dict.fromkeys(handle.keys(), path)

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def read(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self._where[name]
        try:
            with safe_open(path, framework="pt") as handle:  # mapped for this one read
                return handle.get_tensor(name).clone()  # the copy holds no page of the file
        except OSError as error:
            raise ModelAccessError(f"cannot read {path}: {error}") from error
