"""Weight-only quantization of a loaded model's linear layers: --quantize auto|none|int8|int4.

plan_quantization settles, from the request, the device, the dtype and what the machine
offers alone, which scheme each kind of layer gets; quantize_model carries a plan out on
a loaded model, in place, in under a second for the default model (so the result is not
cached). Activations stay in the model's dtype; only weights are stored in fewer bits.

Why these schemes (measured on the CI CPU in eager mode, default model; README, Benchmarks):

- int4 on CPU is TiledInt4Linear (streamchat's own kernel, AVX-512 VNNI or AVX2, placement/native.py)
  where the kernels build, else Int4Linear (aten's _weight_int4pack_mm_for_cpu, called
  directly: torchao's Int4OpaqueTensor reaches the same kernel through a tensor subclass
  whose dispatch cost ate the gain). Groups of 32 are the groups of the GGUF Q4_1 blocks
  the default model ships in. auto picks it for bfloat16 and float16 models: 25 % faster than int8 on an
  AVX-512 CPU and within 2 % of float32's perplexity (+0.26 %). float32 models stay
  unquantized: the kernels' float32 paths are slower than a float32 product on AVX2 CPUs.
  On CUDA, torchao's tinygemm layout (_weight_int4pack_mm): bfloat16 only, compute
  capability 8.0 or newer.
- int8 on CPU is TiledInt8Linear where streamchat's kernels build: int8 in GGUF Q8_0's blocks (a scale per 32
  inputs), so a Q8_0 file's weights are held exactly, and auto keeps such a file in int8 (source_blocks). Else
  Int8Linear (aten's _weight_int8pack_mm, a scale per row): torchao's int8 tensor converts
  the whole weight to the activations' dtype on every eager call (slower than bf16), and
  optimum-quanto reaches the same kernel through enough Python to lose most of its gain.
  On CUDA, torchao's Int8WeightOnlyConfig: eager it dequantizes per call too, and pays
  under torch.compile, which fuses the dequantization into the matmul.
- The output projection (lm_head, a quarter of the default model's weights) is kept out
  of int4: int4 there costs 7.3 % perplexity (+0.31 % with it in int8, default model,
  bfloat16). On CPU it takes int8 instead, with float32 logits so that half precision's
  rounding does not decide between close tokens (TiledInt8Head through the native kernel;
  else Int8Head, each row's best recomputed in float32); on CUDA it stays in the model's
  dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Literal, NamedTuple

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.placement.device import Accelerators

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

    from streamchat.placement.native import NativeKernels

QUANTIZE_NAMES = ", ".join(defaults.QUANTIZATIONS)
KV_CACHE_NAMES = ", ".join(defaults.KV_CACHES)
# The install line a missing or unusable torchao points at: the range pyproject.toml pins.
TORCHAO_REQUIREMENT = "torchao>=0.18,<0.19"

Scheme = Literal["int8-aten", "int4-aten", "int8-torchao", "int4-torchao-cuda"]
# On CUDA int4 weights share a scale and zero point per group of this many inputs: the usual
# 128 where a layer's width allows, else a smaller one. (On CPU: Int4Linear's GROUP_SIZE.)
CUDA_INT4_GROUP_SIZES = (128, 64, 32)
# torchao's tinygemm CUDA kernel uses tensor-core instructions from Ampere (8.0) on.
CUDA_INT4_MIN_CAPABILITY = (8, 0)


@dataclass(frozen=True)
class QuantizationPlan:
    """Which scheme the decoder's linear layers and the output projection get; None keeps a layer as loaded."""

    method: str  # "none", "int8" or "int4": what --quantize settled on
    layers: Scheme | None = None
    head: Scheme | None = None


NO_QUANTIZATION = QuantizationPlan("none")


def is_quantize_name(name: str) -> bool:
    """Whether `name` spells a --quantize value (see QUANTIZE_NAMES)."""
    return name in defaults.QUANTIZATIONS


def is_kv_cache_name(name: str) -> bool:
    """Whether `name` spells a --kv-cache value (see KV_CACHE_NAMES)."""
    return name in defaults.KV_CACHES


def plan_kv_cache(requested: str, native_kernels: bool) -> str:
    """Settle --kv-cache: "full" or "int8" (cache/quantized_kv.py); auto by whether streamchat's own CPU kernels
    run the model (`native_kernels`), which read an int8 window without widening it."""
    if not is_kv_cache_name(requested):
        raise ConfigError(f"--kv-cache {requested!r} is not a KV cache format; choose one of {KV_CACHE_NAMES}")
    if requested != "auto":
        return requested
    return defaults.AUTO_KV_CACHE_NATIVE if native_kernels else defaults.AUTO_KV_CACHE


def precision_label(dtype: torch.dtype, quantization: str) -> str:
    """ "bfloat16 int8", "float32": the weights' dtype, and the quantization --quantize settled on if any."""
    name = str(dtype).removeprefix("torch.")
    return name if quantization == NO_QUANTIZATION.method else f"{name} {quantization}"


def plan_quantization(
    requested: str, device: str, dtype: str, accelerators: Accelerators, source_blocks: bool = False
) -> QuantizationPlan:
    """Settle --quantize for a model placed on `device` in `dtype` (both as plan_placement settled them);
    `source_blocks`: its weights come as int8 blocks (a Q8_0 GGUF), which auto keeps where the CPU kernels
    take them rather than rounding them to int4."""
    if not is_quantize_name(requested):
        raise ConfigError(f"--quantize {requested!r} is not a quantization; choose one of {QUANTIZE_NAMES}")
    kind = device.split(":")[0]  # "cuda:1" is a CUDA device
    method = _settle_auto(kind, dtype) if requested == "auto" else requested
    if requested == "auto" and method == "int4" and kind == "cpu" and source_blocks and accelerators.cpu_kernels:
        method = defaults.AUTO_QUANTIZE_CPU_INT8_BLOCKS
    if method == "none":
        return NO_QUANTIZATION
    if kind == "cpu":
        if method == "int8":
            return QuantizationPlan("int8", layers="int8-aten", head="int8-aten")
        return QuantizationPlan("int4", layers="int4-aten", head="int8-aten")
    if kind == "cuda":
        if method == "int8":
            return QuantizationPlan("int8", layers="int8-torchao", head=None)
        _check_cuda_int4(dtype, accelerators)
        return QuantizationPlan("int4", layers="int4-torchao-cuda", head=None)
    raise ConfigError(f"--quantize {method} is not supported on {device}; use --quantize none or --device cpu")


def _settle_auto(kind: str, dtype: str) -> str:
    if kind == "cpu":
        return defaults.AUTO_QUANTIZE_CPU_FLOAT32 if dtype == "float32" else defaults.AUTO_QUANTIZE_CPU
    if kind == "cuda":
        return defaults.AUTO_QUANTIZE_CUDA
    return "none"


def _check_cuda_int4(dtype: str, accelerators: Accelerators) -> None:
    if dtype != "bfloat16":
        raise ConfigError(
            f"--quantize int4 on CUDA computes in bfloat16 only, not {dtype}; "
            "add --dtype bfloat16 or use --quantize int8"
        )
    if accelerators.cuda_capability < CUDA_INT4_MIN_CAPABILITY:
        found = ".".join(map(str, accelerators.cuda_capability))
        raise ConfigError(
            f"--quantize int4 on CUDA needs compute capability 8.0 or newer (Ampere), this GPU has {found}; "
            "use --quantize int8 or none"
        )


# ---- carrying a plan out ----------------------------------------------------------------------


def quantize_model(
    model: PreTrainedModel,
    plan: QuantizationPlan,
    native: NativeKernels | None = None,
    within: torch.nn.Module | None = None,
) -> int:
    """Quantize `model`'s linear layers in place as `plan` says, and where they are streamchat's CPU layers its
    input embedding too (int8 blocks, once `within` is the whole model); return how many layers were quantized.

    `within`: only the layers inside that module of `model` (a decoder layer just filled, while the rest of
    the model is still being read). A layer whose shape the scheme's kernel cannot take stays as it is, and
    so does one quantized already. int4 layers on a CPU go through streamchat's own kernel where there is
    one (`native`, placement/native_layers.py), else through aten's.
    """
    if plan.method == "none":
        return 0
    import torch

    head = model.get_output_embeddings()
    scope = model if within is None else within
    count = 0
    if plan.layers is not None:
        chosen = lambda module: isinstance(module, torch.nn.Linear) and module is not head  # noqa: E731
        count += _apply(model, scope, plan.layers, chosen, native)
    if plan.head is not None and isinstance(head, torch.nn.Linear):
        count += _apply(model, scope, plan.head, lambda module: module is head, native)
    if scope is model and quantizes_while_loading(plan):
        # After the head, which a tied table quantizes from: the embedding is made int8 blocks in turn.
        count += _pack_embedding(model)
    return count


def _pack_embedding(model: PreTrainedModel) -> int:
    """The input embedding as int8 blocks (placement/int8_linear.py: Q8_0's layout); 1 where it was packed."""
    from streamchat.placement.int8_linear import BlockInt8Embedding, fits_block_embedding

    embedding = model.get_input_embeddings()
    if not fits_block_embedding(embedding):
        return 0
    model.set_input_embeddings(BlockInt8Embedding(embedding))
    return 1


def quantizes_while_loading(plan: QuantizationPlan) -> bool:
    """Whether `plan` quantizes each layer as soon as its weights are read (streamchat's CPU layers), rather
    than the whole model once it sits on its device (torchao's, on CUDA)."""
    return plan.layers in (None, "int8-aten", "int4-aten") and plan.head in (None, "int8-aten")


def takes_grids(plan: QuantizationPlan, native: NativeKernels | None) -> bool:
    """Whether the CPU layers `plan` makes take a GGUF's blocks as they are (int4_linear.GridLinear): the int4
    layers, and the int8 ones in blocks (streamchat's kernels); aten's int8 layers quantize values per row."""
    return quantizes_while_loading(plan) and (plan.method == "int4" or (plan.method == "int8" and native is not None))


def _apply(
    model: PreTrainedModel,
    scope: torch.nn.Module,
    scheme: Scheme,
    chosen: Callable[[torch.nn.Module], bool],
    native: NativeKernels | None,
) -> int:
    if scheme in ("int8-aten", "int4-aten"):
        return _replace_linear_layers(model, scope, _layer_maker(scheme, native), chosen)
    torchao = _import_torchao(scheme)
    if scheme == "int8-torchao":
        config = torchao.quantization.Int8WeightOnlyConfig(set_inductor_config=False)
        return _torchao_quantize(torchao, scope, config, chosen)
    import torch

    count = 0
    for size in CUDA_INT4_GROUP_SIZES:
        config = torchao.quantization.Int4WeightOnlyConfig(
            group_size=size, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )

        def in_this_group(module: torch.nn.Module, size: int = size) -> bool:
            # A chosen layer is a linear one: the isinstance only tells the type checker so.
            return chosen(module) and isinstance(module, torch.nn.Linear) and _cuda_int4_group_size(module) == size

        count += _torchao_quantize(torchao, scope, config, in_this_group)
    return count


def _cuda_int4_group_size(linear: torch.nn.Linear) -> int | None:
    """The largest group size that divides the layer's inputs."""
    return next((size for size in CUDA_INT4_GROUP_SIZES if linear.in_features % size == 0), None)


def _torchao_quantize(
    torchao: ModuleType, model: torch.nn.Module, config: object, chosen: Callable[[torch.nn.Module], bool]
) -> int:
    chosen_names = {name for name, module in model.named_modules() if chosen(module)}
    if chosen_names:
        torchao.quantization.quantize_(model, config, filter_fn=lambda module, name: name in chosen_names)
    return len(chosen_names)


class _LayerMaker(NamedTuple):
    """What replaces a chosen linear layer (as the output projection, `head`), and which layers it takes."""

    layer: Callable[[torch.nn.Linear], torch.nn.Module]
    head: Callable[[torch.nn.Linear], torch.nn.Module]
    fits: Callable[[torch.nn.Linear], bool]


def _layer_maker(scheme: Scheme, native: NativeKernels | None) -> _LayerMaker:
    from streamchat.placement.int8_linear import Int8Linear, fits_int8_kernel

    if scheme == "int8-aten" and native is not None:
        from streamchat.placement.native_layers import TiledInt8Linear, fits_native_int8_blocks

        blocks = functools.partial(TiledInt8Linear, kernels=native)
        return _LayerMaker(blocks, _int8_head_maker(native), fits_native_int8_blocks)
    if scheme == "int8-aten":
        return _LayerMaker(Int8Linear, _int8_head_maker(native), fits_int8_kernel)
    if native is not None:
        from streamchat.placement.native_layers import TiledInt4Linear, fits_native_int4

        tiled = functools.partial(TiledInt4Linear, kernels=native)
        return _LayerMaker(tiled, tiled, fits_native_int4)
    from streamchat.placement.int4_linear import Int4Linear, fits_int4_kernel

    return _LayerMaker(Int4Linear, Int4Linear, fits_int4_kernel)


def _int8_head_maker(native: NativeKernels | None) -> Callable[[torch.nn.Linear], torch.nn.Module]:
    """The int8 output head: through streamchat's own kernel where it takes the head, else aten's (Int8Head)."""
    from streamchat.placement.int8_linear import Int8Head

    if native is None:
        return Int8Head
    from streamchat.placement.native_layers import TiledInt8Head, fits_native_int8

    return lambda linear: TiledInt8Head(linear, native) if fits_native_int8(linear) else Int8Head(linear)


def _replace_linear_layers(
    model: PreTrainedModel, scope: torch.nn.Module, maker: _LayerMaker, chosen: Callable[[torch.nn.Module], bool]
) -> int:
    """Replace the chosen linear layers within `scope` that `maker` takes with the quantized layers it makes."""
    import torch

    # Collected first: replacing children while walking the module tree would skip some. (A chosen layer is a
    # linear one: the isinstance only tells the type checker so.)
    targets = [
        (parent, name, child)
        for parent in scope.modules()
        for name, child in parent.named_children()
        if chosen(child) and isinstance(child, torch.nn.Linear) and maker.fits(child)
    ]
    head = model.get_output_embeddings()
    for parent, name, child in targets:
        if child is head:
            # Unties a shared embedding: the input side keeps its float table (one row read per token).
            model.set_output_embeddings(maker.head(child))
        else:
            setattr(parent, name, maker.layer(child))
    return len(targets)


def _import_torchao(scheme: str) -> ModuleType:
    """torchao (its import warnings are silenced in streamchat/__init__.py)."""
    method = scheme.split("-")[0]
    try:
        import torchao
        import torchao.quantization
    except ImportError as error:
        raise ConfigError(
            f"--quantize {method} needs torchao ({error}); pip install '{TORCHAO_REQUIREMENT}', or use --quantize none"
        ) from None
    return torchao
