"""A model built without weights, then filled a decoder layer at a time from a WeightSource.

    model = empty_model(config, dtype, attention)     # every parameter on the meta device: no memory
    fuse_projections(model)                           # the layout it runs in, still empty
    fill_model(model, source, dtype, device, finish)  # each layer read, converted, finished (quantized)

Each decoder layer's tensors are read from the source, converted to the model's dtype on its
device, and handed to `finish` (quantization, on a CPU) before the next layer is read, so the
float weights of one layer at most are in memory beside the finished ones: a 7B model in
bfloat16 (13.5 GB) loads into its 4.4 GB of packed weights.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from streamchat.errors import ModelAccessError
from streamchat.placement.fusion import unfused_names
from streamchat.placement.int4_linear import Grid, GridLinear, Int4Grid
from streamchat.placement.int8_linear import Int8Blocks
from streamchat.weights.sources import SourceTensor, WeightSource

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Finish = Callable[[torch.nn.Module], None]


def empty_model(config: object, dtype: torch.dtype, attention: str, trust_remote_code: bool = False) -> PreTrainedModel:
    """The model `config` describes, its parameters on the meta device (its buffers, rotary tables, real)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention, trust_remote_code=trust_remote_code
        )
    if _tied_head_name(model) is not None:  # one tensor, counted once, filled once
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    return model.eval()


def missing_tensors(model: PreTrainedModel, source: WeightSource) -> list[str]:
    """The checkpoint names `model` needs that `source` lacks (a tied output head excepted)."""
    held = set(source.names())
    tied_head = _tied_head_name(model)
    return [
        part
        for name, _ in _empty_tensors(model)
        if name != tied_head
        for part in unfused_names(name)
        if part not in held
    ]


def fill_model(
    model: PreTrainedModel,
    source: WeightSource,
    dtype: torch.dtype,
    device: torch.device,
    finish: Finish,
    grids: bool = False,
) -> None:
    """Fill every empty tensor of `model` from `source`, a decoder layer at a time, `finish`ing each layer as
    it is filled, then the rest of the model (embeddings, final norm, output head) and `finish(model)`.

    `grids`: a decoder layer's linear layer whose source is a GGUF's blocks (a 4-bit grid, int8 blocks) is a
    GridLinear when `finish` sees it (for a quantized layer to take as it is; made values after, if `finish`
    leaves it); else every weight is made values in `dtype`.
    """
    reading = _Reading(source, dtype, device)
    layers = _decoder_layers(model)
    prefix = _prefix_of(model, layers)
    for index, layer in enumerate(layers or ()):
        reading.fill(layer, f"{prefix}{index}.", grids=grids)
        finish(layer)
        _grids_as_values(layer)  # what finishing left unpacked
    tied_head = _tied_head_name(model)
    reading.fill(model, "", skip=tied_head)  # the embeddings, the final norm, an untied output head
    if tied_head is not None:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    for name, buffer in model.named_buffers():
        if buffer.device != device and not buffer.is_meta:  # rotary tables: made on the host at build time
            _set(model, name, buffer.to(device))
    finish(model)
    empty = [name for name, _ in _empty_tensors(model)]
    if empty:
        raise ModelAccessError(f"the weights lack {', '.join(empty[:3])}{', ...' if len(empty) > 3 else ''}")


class _Reading:
    """Tensors read from a source into a model's dtype and device."""

    def __init__(self, source: WeightSource, dtype: torch.dtype, device: torch.device) -> None:
        self.source, self.dtype, self.device = source, dtype, device
        self.held = set(source.names())

    def fill(self, scope: torch.nn.Module, prefix: str, skip: str | None = None, grids: bool = False) -> None:
        """Every empty tensor of `scope` (named `prefix` + its name in the model), but `skip`; linear layers on a
        grid as GridLinears where `grids`."""
        linears = {name for name, module in scope.named_modules() if type(module) is torch.nn.Linear}
        for name, _ in list(_empty_tensors(scope)):
            owner = name.rpartition(".")[0]
            if prefix + name == skip or (owner in linears and name.endswith(".bias")):  # a bias comes with its weight
                continue
            if owner in linears and name.endswith(".weight"):
                _set(scope, owner, self.linear(prefix + owner, grids))
            else:
                values = self.values(unfused_names(prefix + name))
                _set(scope, name, torch.nn.Parameter(values, requires_grad=False))

    def linear(self, name: str, grids: bool) -> torch.nn.Linear:
        """The linear layer `name`, its weight (and bias) read: a GridLinear where `grids` and every part is one."""
        bias_names = unfused_names(f"{name}.bias")
        bias = self.values(bias_names) if bias_names[0] in self.held else None
        weights = [self.source.read(part) for part in unfused_names(f"{name}.weight")]
        kinds = {type(weight) for weight in weights}
        if grids and len(kinds) == 1 and kinds <= {Int4Grid, Int8Blocks}:
            joined = [torch.cat(parts) for parts in zip(*weights, strict=True)]  # the parts' rows, in order
            return GridLinear(Int4Grid(*joined) if kinds == {Int4Grid} else Int8Blocks(*joined), bias, self.dtype)
        weight = _joined(weights, self.dtype, self.device)
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        return linear

    def values(self, names: list[str]) -> torch.Tensor:
        return _joined([self.source.read(name) for name in names], self.dtype, self.device)


def _joined(tensors: list[SourceTensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tensors' values in `dtype` on `device`, rows of several parts joined in order."""
    values = [tensor.dense(dtype) if isinstance(tensor, Grid) else tensor for tensor in tensors]
    joined = values[0] if len(values) == 1 else torch.cat([value.to(dtype) for value in values])
    return joined.to(device=device, dtype=dtype if joined.is_floating_point() else joined.dtype)


def _grids_as_values(scope: torch.nn.Module) -> None:
    for name, module in list(scope.named_modules()):
        if isinstance(module, GridLinear):
            _set(scope, name, module.as_values())


def _set(scope: torch.nn.Module, name: str, value: torch.nn.Module | torch.Tensor) -> None:
    owner_name, _, leaf = name.rpartition(".")
    owner = scope.get_submodule(owner_name)
    if isinstance(value, torch.nn.Module):
        setattr(owner, leaf, value)
    elif leaf in owner._buffers:
        owner._buffers[leaf] = value
    else:
        owner._parameters[leaf] = value  # type: ignore[assignment]  # a Parameter, made by the caller


def _empty_tensors(scope: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    seen: set[int] = set()
    for name, tensor in [*scope.named_parameters(remove_duplicate=False), *scope.named_buffers()]:
        if tensor.is_meta and id(tensor) not in seen:
            seen.add(id(tensor))
            yield name, tensor


def _tied_head_name(model: PreTrainedModel) -> str | None:
    """The output head's weight name where the config ties it to the input embeddings."""
    config = model.config.get_text_config(decoder=True)
    head = model.get_output_embeddings()
    if not getattr(config, "tie_word_embeddings", False) or head is None:
        return None
    return next(name for name, module in model.named_modules() if module is head) + ".weight"


def _decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    """The model's stack of decoder layers: the ModuleList holding most of its parameters."""
    lists = [module for module in model.modules() if isinstance(module, torch.nn.ModuleList) and len(module)]
    return max(lists, key=lambda layers: sum(p.numel() for p in layers.parameters()), default=None)


def _prefix_of(model: torch.nn.Module, layers: torch.nn.ModuleList | None) -> str:
    return "" if layers is None else next(name for name, module in model.named_modules() if module is layers) + "."
