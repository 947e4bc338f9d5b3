"""Fewer, larger matrix products: q/k/v and gate/up fused per layer into one weight each, at load time.

A decode pass multiplies one activation row by every weight: seven products a layer,
each too small to reach the memory bandwidth one large product does (211 products a
token for the default model at about 10 GB/s, against about 25 GB/s for one large one:
shared/notes/performance.md). Products that read the same input become one:

    self_attn.qkv_proj    [q_out + k_out + v_out, hidden]   (q_proj, k_proj, v_proj)
    mlp.gate_up_proj      [2 * intermediate, hidden]         (gate_proj, up_proj)

The fused layer is a plain nn.Linear, made before quantization, so --quantize turns it
into one Int8Linear or Int4Linear like any other: per output row (int8) or
per row and group of inputs (int4), so its quantized values are those of the separate
layers, rows side by side. The model keeps one copy of the weights: the old names
(q_proj, ..., up_proj) become `ProjectionPart`s that take their slice of the fused
output, computed once per input, so the model's own forward runs on as it did. The lean
decode pass (placement/lean_forward.py) calls the fused layers directly.

Only the llama-shaped families are fused (their attention and MLP read each input in
the same way); under tensor parallelism nothing is, since transformers' plans name the
separate layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Model types whose decoder layers are llama's: self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj.
FUSED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
QKV = ("q_proj", "k_proj", "v_proj")
GATE_UP = ("gate_proj", "up_proj")
FUSED_PARTS = {"qkv_proj": QKV, "gate_up_proj": GATE_UP}


class FusedProjection(torch.nn.Module):
    """One linear layer over several projections of one input: forward(x) gives their outputs, in order."""

    def __init__(self, layers: list[torch.nn.Linear]) -> None:
        super().__init__()
        first = layers[0]
        weight = torch.cat([layer.weight.detach() for layer in layers])  # [sum of outs, in]
        self.linear = torch.nn.Linear(
            first.in_features, weight.shape[0], bias=first.bias is not None, device=weight.device, dtype=weight.dtype
        )
        self.linear.weight = torch.nn.Parameter(weight, requires_grad=False)
        if first.bias is not None:
            bias = torch.cat([layer.bias.detach() for layer in layers])
            self.linear.bias = torch.nn.Parameter(bias, requires_grad=False)
        self.splits = [layer.out_features for layer in layers]
        self._input: torch.Tensor | None = None  # the input whose outputs are held for the parts
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._left = 0

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(hidden).split(self.splits, dim=-1)

    def part(self, hidden: torch.Tensor, index: int) -> torch.Tensor:
        """Output `index` for `hidden`: the product is computed on the first part's call, once per input."""
        if self._input is not hidden:
            self._input, self._outputs, self._left = hidden, self(hidden), len(self.splits)
        output = self._outputs[index]
        self._left -= 1
        if self._left <= 0:  # every part taken: hold nothing between forward passes
            self._input, self._outputs = None, ()
        return output


class ProjectionPart(torch.nn.Module):
    """Where a fused projection was: its slice of the fused layer's output."""

    fused: FusedProjection

    def __init__(self, fused: FusedProjection, index: int) -> None:
        super().__init__()
        # Not a child module: the fused layer is its parent's (qkv_proj), held here by reference only.
        self.__dict__["fused"] = fused
        self.index = index
        self.out_features = fused.splits[index]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fused.part(hidden, self.index)

    def extra_repr(self) -> str:
        return f"part {self.index} of the fused layer, out_features={self.out_features}"


def fusable(model: PreTrainedModel) -> bool:
    """Whether `model` is of a family whose projections fuse_projections joins."""
    config = model.config.get_text_config(decoder=True)
    return config.model_type in FUSED_MODEL_TYPES and _layers(model) is not None


def fuse_projections(model: PreTrainedModel) -> int:
    """Fuse q/k/v and gate/up in every decoder layer of `model`, in place; return how many fused layers it made.

    Call before quantize_model. A model of another family, or one already fused, is left as it is.
    """
    layers = _layers(model)
    if not fusable(model) or layers is None:
        return 0
    count = 0
    for layer in layers:
        attention, mlp = cast(torch.nn.Module, layer.self_attn), cast(torch.nn.Module, layer.mlp)
        count += _fuse(attention, "qkv_proj", QKV) + _fuse(mlp, "gate_up_proj", GATE_UP)
    return count


def unfused_names(name: str) -> list[str]:
    """The checkpoint's names for the model's tensor `name`: the parts' where it is a fused layer's,
    "model.layers.0.self_attn.qkv_proj.linear.weight" -> [..."q_proj.weight", ..."k_proj.weight", ..."v_proj.weight"],
    else `name` itself."""
    parent, _, rest = name.rpartition(".linear.")
    owner, _, fused_name = parent.rpartition(".")
    if not rest or fused_name not in FUSED_PARTS:
        return [name]
    return [f"{owner}.{part}.{rest}" for part in FUSED_PARTS[fused_name]]


def _fuse(parent: torch.nn.Module, fused_name: str, names: tuple[str, ...]) -> int:
    found = [getattr(parent, name, None) for name in names]
    layers = [layer for layer in found if type(layer) is torch.nn.Linear]
    if len(layers) != len(names):
        return 0  # already fused, quantized or of another shape
    if len({(layer.in_features, layer.bias is None) for layer in layers}) != 1:
        return 0
    fused = FusedProjection(layers)
    setattr(parent, fused_name, fused)
    for index, name in enumerate(names):
        setattr(parent, name, ProjectionPart(fused, index))
    return 1


def _layers(model: torch.nn.Module) -> torch.nn.ModuleList | None:
    layers = getattr(getattr(model, "model", None), "layers", None)
    return layers if isinstance(layers, torch.nn.ModuleList) else None
