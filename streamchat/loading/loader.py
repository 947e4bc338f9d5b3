"""load_model: from a --model value to a model and tokenizer ready to chat."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from streamchat import defaults
from streamchat.loading.aliases import CARD_SAMPLING, offline_install
from streamchat.loading.configs import read_supported_config
from streamchat.loading.conversion import Notify, convert_gguf, kernels_dir, packed_dir
from streamchat.loading.failures import model_errors
from streamchat.loading.hub import download_model
from streamchat.loading.integrity import ensure_complete_gguf, ensure_intact_weights
from streamchat.loading.resolve import ModelSource, resolve_model
from streamchat.loading.weights import SAFETENSORS_WEIGHTS, ensure_loadable_weights
from streamchat.placement.device import Placement, detect_accelerators, for_quantization, plan_placement
from streamchat.placement.quantization import (
    QuantizationPlan,
    plan_kv_cache,
    plan_quantization,
    quantize_model,
)
from streamchat.placement.tensor_parallel import (
    ensure_heads_split,
    ensure_no_device_map,
    ensure_tensor_parallel_plan,
    tensor_parallel_quantization,
)

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from streamchat.placement.native import NativeKernels
    from streamchat.weights.streamed import Streamed


@dataclass(frozen=True)
class LoadOptions:
    """Everything that decides which model is loaded, where and how."""

    # An alias, hub id, model directory or .gguf file; None means the default model.
    model: str | None = None
    device: str = defaults.DEVICE
    dtype: str = defaults.DTYPE
    # Weight-only quantization of the linear layers (loading/quantization.py).
    quantize: str = defaults.QUANTIZE
    # How the cache stores its window's keys and values (--kv-cache): auto, full or int8.
    kv_cache: str = defaults.KV_CACHE
    # "auto" spreads the model over all GPUs through accelerate; None keeps it on one device.
    device_map: str | None = None
    trust_remote_code: bool = False
    allow_pickle: bool = False
    # Ranks the model is sharded over by transformers' tensor-parallel plan (--tp); 1 loads it whole.
    # Above 1, torch.distributed's default process group must be up (streamchat.distributed.group).
    tp_size: int = 1


@dataclass(frozen=True)
class LoadedModel:
    """A model ready for generation, with what the engine and the UI need to know about it."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    source: ModelSource
    # The local directory the weights came from: the model itself, a hub snapshot or a GGUF conversion.
    directory: Path
    model_type: str
    # Where input ids go: the device of the input embeddings (the first GPU under --device-map auto).
    device: torch.device
    dtype: torch.dtype
    # "none", "int8" or "int4": what --quantize settled on.
    quantization: str
    # The context length the model was trained for, if its config says.
    max_context: int | None
    parameters: int
    load_seconds: float
    # Of load_seconds, the time the weights took: read, converted and quantized, or read from the packed copy.
    quantize_seconds: float = 0.0
    # How the weights were read: "files" (a tensor at a time), "packed copy" (a later start of a quantized
    # model) or "transformers" (its own loader: --tp, --device-map auto, renamed or pickled checkpoints).
    weights_from: str = "files"
    # The packed copy of a model quantized on the CPU: written at its first start, read at later ones.
    packed_copy: Path | None = None
    # streamchat's own CPU kernels this model runs through (placement/native.py), if any.
    native: NativeKernels | None = None
    # "full" or "int8": what --kv-cache settled on, the format every cache for this model takes.
    kv_cache: str = "full"

    @property
    def has_chat_template(self) -> bool:
        return self.tokenizer.chat_template is not None


def _ignore(message: str) -> None:
    pass


def load_model(options: LoadOptions, notify: Notify = _ignore) -> LoadedModel:
    """Resolve, fetch or convert if needed, check, and load `options.model`.

    `notify` receives one-line progress notes (such as a first GGUF conversion) for the UI.
    Every failure a user can fix is raised as a StreamchatError subclass.
    """
    started = time.perf_counter()
    source = resolve_model(options.model)
    # Settled first: an unavailable device should fail before a download or a conversion.
    accelerators = detect_accelerators()
    quantize = options.quantize
    if options.tp_size > 1:
        ensure_no_device_map(options.device_map)
        quantize = tensor_parallel_quantization(quantize)
    placing = for_quantization(accelerators, quantize)  # bfloat16 for the kernels only where they run the layers
    placement = plan_placement(options.device, options.dtype, options.device_map, placing)
    source_blocks = quantize == "auto" and source.kind == "gguf" and _holds_int8_blocks(source.path)
    quantization = plan_quantization(quantize, placement.device, placement.dtype, accelerators, source_blocks)
    plan_kv_cache(options.kv_cache, native_kernels=False)  # a bad name is refused before any download
    directory = _local_directory(source, options, notify)
    config = read_supported_config(directory, source.name, trust_remote_code=options.trust_remote_code)
    if options.tp_size > 1:
        ensure_tensor_parallel_plan(config, source.name)
        ensure_heads_split(config, options.tp_size, source.name)
    gguf = source.path if source.kind == "gguf" else None
    if gguf is None:
        ensure_loadable_weights(directory, source.name, allow_pickle=options.allow_pickle)
        ensure_intact_weights(directory, remedy="delete it and download the model again")
    else:
        ensure_complete_gguf(gguf)
    native = native_kernels(placement.device, placement.dtype, quantization)  # built once per machine
    whole = options.tp_size == 1 and placement.device_map != "auto"  # the model on one device
    if whole:
        from streamchat.weights.footprint import available_device_memory, ensure_fits, model_footprint  # torch

        # Before any weight is read: a model that cannot fit is refused in a line, not killed mid-load.
        footprint = model_footprint(config, placement.dtype, quantization.method, defaults.WINDOW, native is not None)
        ensure_fits(source.name, footprint, available_device_memory(placement.device))
    loading = time.perf_counter()
    streamable = whole and (gguf is not None or _has_safetensors(directory))
    weights = _load_weights(directory, gguf, config, placement, quantization, native, options, source.name, streamable)
    quantize_seconds = time.perf_counter() - loading
    tokenizer = _load_tokenizer(directory, options, source.name)
    model = weights.model
    _card_sampling(model, source)
    from streamchat.cache.quantized_kv import KV_FORMAT_ATTRIBUTE  # imports torch, as the model has

    kv_cache = plan_kv_cache(options.kv_cache, native is not None)
    setattr(model, KV_FORMAT_ATTRIBUTE, kv_cache)  # every cache made for it takes this format (SinkCache.for_model)
    text_config = config.get_text_config(decoder=True)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        source=source,
        directory=directory,
        model_type=text_config.model_type,
        device=cast("torch.Tensor", model.get_input_embeddings().weight).device,
        dtype=model.dtype,
        quantization=quantization.method,
        max_context=getattr(text_config, "max_position_embeddings", None),
        parameters=weights.parameters,
        load_seconds=time.perf_counter() - started,
        quantize_seconds=quantize_seconds,
        weights_from=weights.read_from,
        packed_copy=weights.packed_copy,
        native=native,
        kv_cache=kv_cache,
    )


def fetch_model_files(options: LoadOptions, notify: Notify = _ignore) -> Path:
    """Resolve `options.model` and download or convert its files, without loading it.

    Under --tp every rank does this first, then waits for the others: a download that takes
    longer on one machine must not run into the step timeout of the loading collectives.
    """
    source = resolve_model(options.model)
    return _local_directory(source, options, notify)


def check_shardable(options: LoadOptions, notify: Notify = _ignore) -> None:
    """Before any rank starts: fetch the files, and refuse a model --tp cannot shard over options.tp_size ranks."""
    ensure_no_device_map(options.device_map)
    tensor_parallel_quantization(options.quantize)
    source = resolve_model(options.model)
    directory = _local_directory(source, options, notify)
    config = read_supported_config(directory, source.name, trust_remote_code=options.trust_remote_code)
    ensure_tensor_parallel_plan(config, source.name)
    ensure_heads_split(config, options.tp_size, source.name)


def _card_sampling(model: PreTrainedModel, source: ModelSource) -> None:
    """Give an alias's model the sampling its card recommends where its generation config sets none."""
    recommended = CARD_SAMPLING.get(source.name.lower())
    config = getattr(model, "generation_config", None)
    if recommended is None or config is None or config.do_sample is False:
        return
    for name, value in recommended.items():
        if getattr(config, name, None) is None:
            setattr(config, name, value)


def _has_safetensors(directory: Path) -> bool:
    return any(directory.glob(SAFETENSORS_WEIGHTS))


def _local_directory(source: ModelSource, options: LoadOptions, notify: Notify) -> Path:
    if source.kind == "gguf":
        return convert_gguf(source.path, source.name, notify)
    if source.kind == "hub":
        return download_model(
            source.location,
            allow_pickle=options.allow_pickle,
            trust_remote_code=options.trust_remote_code,
            offline_remedy=offline_install(source.name),
        )
    return source.path


def _load_weights(
    directory: Path,
    gguf: Path | None,
    config: PreTrainedConfig,
    placement: Placement,
    quantization: QuantizationPlan,
    native: NativeKernels | None,
    options: LoadOptions,
    name: str,
    streamable: bool,
) -> Streamed:
    """The model with its weights, quantized: read a tensor at a time where `streamable` (one device, safetensors or
    a GGUF) and the checkpoint names the model's tensors; else through transformers' own loader (sharded, spread,
    pickled, or named otherwise than the model)."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamchat.weights.streamed import Streamed, load_streamed  # imports torch: only once a model loads

    if streamable:
        with model_errors(name):
            streamed = load_streamed(
                directory=directory,
                gguf=gguf,
                config=config,
                dtype=getattr(torch, placement.dtype),
                device=torch.device(placement.device),
                plan=quantization,
                native=native,
                attention=attention_implementation(config),
                packed_root=packed_dir(),
                trust_remote_code=options.trust_remote_code,
            )
        if streamed is not None:
            return streamed
    placing: dict[str, Any]
    if options.tp_size > 1:
        from transformers import DistributedConfig

        # transformers places each rank's shard on that rank's device itself.
        placing = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=options.tp_size)}
    else:
        placing = {"device_map": placement.device_map}
    with model_errors(name), _quiet_transformers():
        model = AutoModelForCausalLM.from_pretrained(
            directory,
            config=config,
            dtype=getattr(torch, placement.dtype),
            **placing,
            attn_implementation=attention_implementation(config),
            # None lets transformers fall back to pickled .bin files when there are no safetensors.
            use_safetensors=None if options.allow_pickle else True,
            trust_remote_code=options.trust_remote_code,
        )
    parameters = model.num_parameters()  # counted before int8 layers turn weights into buffers
    if options.tp_size == 1:
        from streamchat.placement.fusion import fuse_projections  # imports torch: only once a model loads

        fuse_projections(model)  # before quantizing: the fused layers are quantized whole
    quantize_model(model, quantization, native)
    return Streamed(model, parameters, "transformers", None)


def _load_tokenizer(directory: Path, options: LoadOptions, name: str) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    with model_errors(name), _quiet_transformers():
        return AutoTokenizer.from_pretrained(directory, trust_remote_code=options.trust_remote_code)


def _holds_int8_blocks(gguf: Path) -> bool:
    """Whether the GGUF's decoder weights are mostly Q8_0 blocks (weights/gguf_source.py; imports torch)."""
    from streamchat.weights.gguf_source import holds_int8_blocks

    return holds_int8_blocks(gguf)


def native_kernels(device: str, dtype: str, quantization: QuantizationPlan) -> NativeKernels | None:
    """streamchat's own CPU kernels, in use from now on where a model on a CPU has a use for them: its
    attention and norms in bfloat16, its quantized layers (placement/native.py). A float32 model left unquantized
    builds nothing."""
    from streamchat.placement.native import load_native_kernels, use_native_kernels

    wanted = device == "cpu" and (dtype == "bfloat16" or quantization.method in ("int4", "int8"))
    native = load_native_kernels(kernels_dir()) if wanted else None
    if native is not None:  # never off again: a float32 model loaded beside a bfloat16 one leaves it its kernels
        use_native_kernels(native)
    return native


def attention_implementation(config: PreTrainedConfig) -> str:
    """The attention a sink-cached model runs with: streamchat's where the model supports sdpa, else "eager".

    streamchat's attention (placement/attention.py) is sdpa that reads each key/value head
    once for a decode query, compiled too; it is registered with transformers here. The
    sink cache relies on the sdpa/eager attention-mask path; Gemma 2's logit softcapping,
    for one, has no sdpa version.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    from streamchat.placement.attention import register_attention  # imports torch and transformers

    return register_attention() if getattr(model_class, "_supports_sdpa", True) else "eager"


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """No "Loading weights" bar or info logs: a local load takes a second, and the UI says what happens."""
    from transformers.utils import logging as transformers_logging

    verbosity = transformers_logging.get_verbosity()
    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.enable_progress_bar()
        transformers_logging.set_verbosity(verbosity)
