"""The model a benchmark runs: a loaded one (--model), or random weights in a known shape (--random-init).

ModelChoice reads the model options as `run` does and gives either; BenchModel is what a bench measures.

Decode speed depends on a model's shape, not on its weights, so `--random-init llama-2-7b`
measures the paper's model on a GPU with no download and no hub account.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamchat.errors import ConfigError
from streamchat.interface.config import RunConfig, load_options, load_run_config
from streamchat.interface.reporting import notify
from streamchat.placement.quantization import precision_label

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedConfig

_LLAMA_2 = {
    "model_type": "llama",
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# --random-init presets: the configs of known models, without their weights.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        **_LLAMA_2,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "llama-2-13b": {
        **_LLAMA_2,
        "hidden_size": 5120,
        "intermediate_size": 13824,
        "num_hidden_layers": 40,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
    },
    "smollm2-135m": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
        "tie_word_embeddings": True,
    },
    # The sizes people run on CPUs: 1-2B parameters.
    "smollm2-1.7b": {
        "model_type": "llama",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 24,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 130000.0},
        "tie_word_embeddings": True,
    },
    "llama-3.2-1b": {
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "tie_word_embeddings": True,
    },
    # Two small layers: seconds on any CPU, for --quick runs and tests.
    "tiny": {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}
# Weights drawn from a fixed seed, so two runs time the same model.
RANDOM_INIT_SEED = 0


@dataclass(frozen=True)
class BenchModel:
    model: Any
    name: str
    device: torch.device
    dtype: torch.dtype
    quantization: str = "none"
    tokenizer: Any = None  # a loaded model's; random weights have none
    parameters: int = 0  # counted before quantizing (packed layers hold their weights as buffers)
    kv_cache: str = "full"  # what --kv-cache settled on: how the model's caches store keys and values

    @property
    def precision(self) -> str:
        """What a title says the weights run in: "float32", "bfloat16 int8"."""
        return precision_label(self.dtype, self.quantization)


@dataclass(frozen=True)
class ModelChoice:
    """The model options a bench was given, read as `run` reads them: the command line's, else the environment's,
    the config file's, the defaults."""

    model: str | None
    device: str | None
    dtype: str | None
    quantize: str | None
    random_init: str | None = None  # a --random-init spec: random weights in a known shape instead of --model
    kv_cache: str | None = None

    def config(self, **more: object) -> RunConfig:
        """The run configuration, with `more` options as given (None: from the environment, the file, defaults)."""
        if self.model is not None and self.random_init is not None:
            raise ConfigError("--model and --random-init exclude each other: give one")
        return load_run_config({**self.given(), **more})

    def given(self) -> dict[str, str | None]:
        """The model options, by name, as the command line gave them (None: not given)."""
        given = {"model": self.model, "device": self.device, "dtype": self.dtype, "quantize": self.quantize}
        return {**given, "kv_cache": self.kv_cache}

    def bench_model(self, config: RunConfig | None = None) -> BenchModel:
        """--random-init's weights, else the model --model names, loaded as `run` loads it; `config` may ask for
        another dtype or quantization."""
        from streamchat.loading import load_model

        config = config or self.config()
        if self.random_init is not None:
            return random_model(self.random_init, config.device, config.dtype, config.quantize, config.kv_cache)
        loaded = load_model(load_options(config), notify=notify)
        return BenchModel(
            loaded.model,
            loaded.source.name,
            loaded.device,
            loaded.dtype,
            loaded.quantization,
            loaded.tokenizer,
            loaded.parameters,
            loaded.kv_cache,
        )


def random_config(spec: str) -> PreTrainedConfig:
    """A preset name, a config.json (or a directory holding one), or a transformers model type."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = Path(spec).expanduser()
    if spec in PRESETS:
        fields = dict(PRESETS[spec])
    elif path.is_dir() or path.suffix == ".json":
        fields = _read_config(path / "config.json" if path.is_dir() else path, spec)
    elif spec in CONFIG_MAPPING:
        fields = {"model_type": spec}
    else:
        raise ConfigError(
            f"--random-init {spec!r}: not a preset ({', '.join(PRESETS)}), a config.json file or a model type"
        )
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"--random-init {spec}: model_type {model_type!r} is not a transformers model type")
    return CONFIG_MAPPING[model_type](**fields)


def random_model(spec: str, device: str, dtype: str, quantize: str = "none", kv_cache: str = "full") -> BenchModel:
    """Random weights in the shape `spec` describes, created directly on the device, quantized as `quantize` says."""
    import torch
    from transformers import AutoModelForCausalLM

    from streamchat.cache.architectures import ensure_supported
    from streamchat.cache.quantized_kv import KV_FORMAT_ATTRIBUTE
    from streamchat.loading.loader import attention_implementation, native_kernels
    from streamchat.placement.device import detect_accelerators, for_quantization, plan_placement
    from streamchat.placement.fusion import fuse_projections
    from streamchat.placement.quantization import plan_kv_cache, plan_quantization, quantize_model

    accelerators = detect_accelerators()
    placement = plan_placement(device, dtype, None, for_quantization(accelerators, quantize))
    quantization = plan_quantization(quantize, placement.device, placement.dtype, accelerators)
    config = random_config(spec)
    ensure_supported(config)
    torch.manual_seed(RANDOM_INIT_SEED)
    # Built on the device itself: initialising 7B parameters on a CPU first would take minutes.
    with torch.device(placement.device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=getattr(torch, placement.dtype), attn_implementation=attention_implementation(config)
        )
    model.eval()
    parameters = model.num_parameters()  # before quantizing, as load_model counts them
    fuse_projections(model)  # as load_model does: before quantizing, the fused layers quantized whole
    native = native_kernels(placement.device, placement.dtype, quantization)
    quantize_model(model, quantization, native)
    settled = plan_kv_cache(kv_cache, native is not None)
    setattr(model, KV_FORMAT_ATTRIBUTE, settled)  # as load_model does: every cache for it takes this format
    placed = torch.device(placement.device)
    name, method = f"random {spec}", quantization.method
    return BenchModel(model, name, placed, model.dtype, method, parameters=parameters, kv_cache=settled)


def device_type(device: str) -> str:
    """ "cpu" or "cuda": where a model placed on `device` runs ("auto" settles as loading will settle it)."""
    from streamchat.placement.device import choose_device, detect_accelerators

    return choose_device(device, detect_accelerators()).split(":")[0]


def _read_config(path: Path, spec: str) -> dict[str, Any]:
    try:
        fields = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"--random-init {spec}: no such file {path}") from None
    except (OSError, ValueError) as error:
        raise ConfigError(f"--random-init {spec}: {path} is not a readable JSON config ({error})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"--random-init {spec}: {path} holds no JSON object")
    return fields
