"""load_streamed: a model built empty, then filled a layer at a time from its files, or from its packed copy.

Peak memory while loading stays near the model's final size plus one layer in float: the
weights go from their files (safetensors, GGUF; read a tensor at a time, nothing kept mapped)
through the model's dtype to their packed form layer by layer (weights/filling.py). A model
quantized on the CPU is written once, packed, to streamchat's cache (weights/packed_copy.py);
later starts read that copy instead.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from streamchat.errors import ModelAccessError
from streamchat.placement.fusion import fuse_projections
from streamchat.placement.quantization import QuantizationPlan, quantize_model, quantizes_while_loading, takes_grids
from streamchat.weights.filling import empty_model, fill_model, missing_tensors
from streamchat.weights.packed_copy import packed_copy_path, read_packed_copy, write_packed_copy

if TYPE_CHECKING:
    import torch
    from transformers import GenerationConfig, PreTrainedConfig, PreTrainedModel

    from streamchat.placement.native import NativeKernels
    from streamchat.weights.sources import WeightSource


@dataclass(frozen=True)
class Streamed:
    """What load_streamed made: the model, its parameter count before packing, and how it was read."""

    model: PreTrainedModel
    parameters: int
    # Where its weights came from this time: "files" or "packed copy".
    read_from: str
    # The packed copy read or written; None where the model is not packed on the CPU.
    packed_copy: Path | None


def load_streamed(
    *,
    directory: Path,
    gguf: Path | None,
    config: PreTrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    plan: QuantizationPlan,
    native: NativeKernels | None,
    attention: str,
    packed_root: Path,
    trust_remote_code: bool = False,
) -> Streamed | None:
    """`directory`'s model (its weights in `gguf` where given) on `device`, quantized as `plan` says.

    None where the checkpoint's tensor names are not the model's (a checkpoint transformers renames on
    load): the caller loads it through transformers instead.
    """
    import torch

    from streamchat.weights.gguf_source import GgufSource
    from streamchat.weights.sources import SAFETENSORS_FILES, SafetensorsSource

    in_stream = quantizes_while_loading(plan)
    packed = None
    if in_stream and plan.method != "none" and device.type == "cpu":
        files = [gguf] if gguf is not None else [directory / "config.json", *directory.glob(SAFETENSORS_FILES)]
        packed = packed_copy_path(packed_root, gguf or directory, files, _layout(plan, dtype, native))
    model = empty_model(config, dtype, attention, trust_remote_code)
    parameters = model.num_parameters()
    fuse_projections(model)
    if packed is not None and packed.is_file():
        skeleton = copy.deepcopy(model)  # still empty: a copy costs nothing
        quantize_model(skeleton, plan, native)  # on the meta device: the packed layers' shapes, no work
        if read_packed_copy(skeleton, packed):
            skeleton.generation_config = _generation_config(directory, skeleton)
            return Streamed(skeleton, parameters, "packed copy", packed)
    source: WeightSource = GgufSource(gguf, model) if gguf is not None else SafetensorsSource(directory)
    missing = missing_tensors(model, source)
    if missing and gguf is None:
        return None
    if missing:
        raise ModelAccessError(f"{gguf} lacks the tensors for {', '.join(missing[:3])}; it does not fit its config")

    def finish(scope: torch.nn.Module) -> None:
        if in_stream:
            quantize_model(model, plan, native, within=scope)

    with torch.no_grad():
        fill_model(model, source, dtype, device, finish, grids=device.type == "cpu" and takes_grids(plan, native))
    if not in_stream:
        quantize_model(model, plan, native)  # torchao's, on the device, once the whole model is there
    if packed is not None:
        write_packed_copy(model, packed)
    model.generation_config = _generation_config(directory, model)
    return Streamed(model, parameters, "files", packed)


def _layout(plan: QuantizationPlan, dtype: torch.dtype, native: NativeKernels | None) -> str:
    """What the packed tensors depend on besides the weights: the layers' kinds and their kernels' layouts."""
    import torch

    from streamchat.placement.int4_linear import packed_layout

    kernels = "native" if native is not None else f"aten {packed_layout()} {torch.backends.cpu.get_cpu_capability()}"
    return f"{plan} {dtype} {kernels} torch {torch.__version__}"


def _generation_config(directory: Path, model: PreTrainedModel) -> GenerationConfig:
    from transformers import GenerationConfig

    if (directory / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(directory)
    return GenerationConfig.from_model_config(model.config)
