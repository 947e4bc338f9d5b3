"""`streamchat bench decode`: decode speed of streamchat against its anchors, side by side in one run.

Same model, prompt and greedy decoding for every row:

- streamchat through the real engine (ChatSession), as `run` loads it by default and as
  `--dtype float32 --quantize none` (the issue's baseline); each row is one Contender;
- transformers' own generate() with a StaticCache on the same loaded model: what a
  transformers user gets (decode time: N tokens minus 1 token, both timed); on CUDA
  generate() compiles the forward pass itself when the cache is static;
- llama.cpp (llama-cpp-python, when installed) on the same GGUF file;
- the memory-bandwidth limit: bytes read per token (weights, plus the KV cache at the
  reply's middle) over a bandwidth measured on the spot with one large GEMV.

Trials rotate through the rows, so load from other processes hits all of them alike;
each row reports its median.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamchat import defaults
from streamchat.bench.report import Check, Column, Row
from streamchat.bench.sizes import require_at_least
from streamchat.engine.events import TurnFinished
from streamchat.engine.session import ChatSession, SessionOptions
from streamchat.engine.settings import GenerationSettings
from streamchat.loading import LoadedModel, LoadOptions

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
# The targets for the CPU default model.
DEFAULTS_VS_FLOAT32_MIN = 2.5
DEFAULTS_VS_LLAMA_CPP_MAX = 2.5
STREAMCHAT_VS_GENERATE_MAX = 1.0
# Bandwidth probe: a float32 matrix far larger than any CPU cache, read by one GEMV.
BANDWIDTH_PROBE_BYTES = 512 * 2**20
BANDWIDTH_PROBE_REPEATS = 5
LLAMA_CPP_MIN_CONTEXT = 512


@dataclass(frozen=True)
class DecodeSizes:
    max_new_tokens: int  # tokens per reply; decode speed counts all but the first
    trials: int  # replies per row
    window: int = defaults.WINDOW
    sinks: int = defaults.SINKS

    def __post_init__(self) -> None:
        require_at_least("--max-new-tokens", self.max_new_tokens, 2)
        require_at_least("--trials", self.trials, 1)


FULL = DecodeSizes(max_new_tokens=64, trials=5)
QUICK = DecodeSizes(max_new_tokens=6, trials=1)


@dataclass(frozen=True)
class Setting:
    """How a row's model is loaded: `run`'s own options."""

    label: str
    dtype: str
    quantize: str


@dataclass(frozen=True)
class Contender:
    """One row: an engine decoding with a model loaded as `setting` says."""

    name: str
    setting: Setting
    # Seconds per decode step of one greedy reply of `max_new_tokens` tokens.
    decode: Callable[[LoadedModel, DecodeSizes], float]
    options: dict[str, Any] = field(default_factory=dict)


def run_defaults(dtype: str, quantize: str) -> Setting:
    """`run`'s defaults, or the --dtype and --quantize the command was given."""
    return Setting("run defaults", dtype, quantize)


BASELINE = Setting("--dtype float32 --quantize none", "float32", "none")


def contenders(defaults_setting: Setting) -> list[Contender]:
    """The rows, in table order; a new row (a compiled session, say) is one more entry."""
    rows = []
    for setting in (defaults_setting, BASELINE):
        rows.append(Contender("streamchat", setting, session_decode))
        rows.append(Contender("transformers generate() + StaticCache", setting, generate_decode))
    return rows


# ---- the engines --------------------------------------------------------------------------------


def session_decode(loaded: LoadedModel, sizes: DecodeSizes, **options: Any) -> float:
    """Seconds per decode step of a greedy reply through ChatSession, from its TurnStats."""
    settings = GenerationSettings(max_new_tokens=sizes.max_new_tokens, temperature=0.0)
    session_options = SessionOptions(sinks=sizes.sinks, window=sizes.window, settings=settings, **options)
    session = ChatSession(loaded.model, loaded.tokenizer, session_options)
    finished = [event for event in session.chat(PROMPT) if isinstance(event, TurnFinished)]
    speed = finished[0].stats.decode_tokens_per_second
    return 1 / speed if speed > 0 else float("nan")


def prompt_ids(loaded: LoadedModel) -> torch.Tensor:
    """The prompt as the chat template renders it: ids [1, n]."""
    messages = [{"role": "user", "content": PROMPT}]
    rendered = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return loaded.tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids.to(loaded.device)


def generate_decode(loaded: LoadedModel, sizes: DecodeSizes) -> float:
    """Seconds per decode step of generate() with a StaticCache: (time for N tokens - time for 1) / (N - 1)."""
    ids = prompt_ids(loaded)

    def timed(new_tokens: int) -> float:
        _synchronize(loaded.device)
        started = time.perf_counter()
        with torch.inference_mode():
            loaded.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                cache_implementation="static",
                pad_token_id=loaded.tokenizer.eos_token_id,
            )
        _synchronize(loaded.device)
        return time.perf_counter() - started

    return (timed(sizes.max_new_tokens) - timed(1)) / (sizes.max_new_tokens - 1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def default_gguf() -> Path | None:
    """The default model's GGUF file, found without importing its package; None when it is not installed."""
    spec = importlib.util.find_spec(defaults.DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / defaults.DEFAULT_MODEL_GGUF
    return path if path.is_file() else None


class LlamaCpp:
    """llama.cpp on a GGUF file, greedy, with as many threads as torch uses."""

    def __init__(self, gguf: Path, context: int) -> None:
        from llama_cpp import Llama

        self.gguf = gguf
        # The prompt goes in one token at a time (n_batch 1), as every decode step does anyway: llama.cpp's
        # AMX matmul for batches dies with SIGILL on VMs that list AMX but do not enable it (the CI machine).
        self.llama = Llama(
            model_path=str(gguf),
            n_ctx=max(context, LLAMA_CPP_MIN_CONTEXT),
            n_batch=1,
            n_ubatch=1,
            n_threads=torch.get_num_threads(),
            verbose=False,
        )

    def decode(self, ids: list[int], sizes: DecodeSizes) -> float:
        """Seconds per decode step: from the first generated token to the last."""
        stamps = []
        for _ in self.llama.generate(ids, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == sizes.max_new_tokens:
                break
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else float("nan")


def llama_cpp_gguf(model: str | None) -> tuple[Path | None, str]:
    """The GGUF llama.cpp reads for `model`, or None and why there is no llama.cpp row."""
    if importlib.util.find_spec("llama_cpp") is None:
        return None, "llama.cpp row skipped: llama-cpp-python is not installed (pip install 'streamchat[llamacpp]')"
    if model is not None and model.endswith(".gguf"):
        return Path(model), ""
    if model not in (None, defaults.DEFAULT_MODEL):
        return None, f"llama.cpp row skipped: {model} is not a GGUF file"
    gguf = default_gguf()
    return (gguf, "") if gguf is not None else (None, "llama.cpp row skipped: the default model is not installed")


# ---- the limit ------------------------------------------------------------------------------------


def measure_bandwidth(device: torch.device) -> float:
    """Bytes per second one large float32 GEMV reads on `device` (the best of a few)."""
    columns = 4096
    matrix = torch.rand(BANDWIDTH_PROBE_BYTES // 4 // columns, columns, device=device)
    vector = torch.rand(columns, device=device)
    best = float("inf")
    for _ in range(BANDWIDTH_PROBE_REPEATS):
        _synchronize(device)
        started = time.perf_counter()
        torch.mv(matrix, vector)
        _synchronize(device)
        best = min(best, time.perf_counter() - started)
    return matrix.numel() * matrix.element_size() / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer a decode step reads: all but the input embedding table.

    Quantized tensors count by their storage (their inner tensors), not by their float shape.
    """
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and getattr(output, "weight", None) is embedding
    total = 0
    seen: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in seen or (tensor is embedding and not tied):
            continue
        seen.add(id(tensor))
        total += _storage_bytes(tensor)
    return total


def _storage_bytes(tensor: torch.Tensor) -> int:
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None or type(tensor) in (torch.Tensor, torch.nn.Parameter):
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(_storage_bytes(getattr(tensor, name)) for name in names if getattr(tensor, name) is not None)


def kv_bytes_per_token(model: torch.nn.Module, context: int, element_bytes: int) -> int:
    """Bytes of keys and values one decode step reads over `context` cached tokens."""
    config = model.config.get_text_config(decoder=True)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * context * element_bytes


def gguf_bytes_per_token(gguf: Path) -> int:
    """Bytes of a GGUF file's tensors: llama.cpp reads all of them per token (a tied output reads the table)."""
    from gguf import GGUFReader

    return sum(int(tensor.n_bytes) for tensor in GGUFReader(gguf).tensors)


# ---- rows, checks -------------------------------------------------------------------------------


def columns() -> list[Column]:
    return [
        Column("engine", "engine"),
        Column("setting", "model loaded as"),
        Column("precision", "precision"),
        Column("ms_per_token", "ms/token", "{:.1f}"),
        Column("tokens_per_second", "tok/s", "{:.1f}"),
        Column("limit_ms", "limit ms", "{:.1f}"),
        Column("x_of_limit", "x of limit", "{:.2f}"),
    ]


def row(engine: str, setting: str, seconds: list[float], limit_seconds: float | None) -> Row:
    median = statistics.median(seconds)
    return {
        "engine": engine,
        "setting": setting,
        "ms_per_token": median * 1000,
        "tokens_per_second": 1 / median,
        "limit_ms": None if limit_seconds is None else limit_seconds * 1000,
        "x_of_limit": None if limit_seconds is None else median / limit_seconds,
    }


def checks(rows: list[Row], defaults_setting: str, device_type: str) -> list[Check]:
    by_key = {(r["engine"], r["setting"]): r["ms_per_token"] for r in rows}
    found = []
    ours = by_key.get(("streamchat", defaults_setting))
    baseline = by_key.get(("streamchat", BASELINE.label))
    if device_type == "cpu" and ours and baseline and defaults_setting != BASELINE.label:
        found.append(Check("run defaults / float32 decode speed", baseline / ours, DEFAULTS_VS_FLOAT32_MIN, False))
    llama = next((r["ms_per_token"] for r in rows if r["engine"] == "llama.cpp"), None)
    if ours and llama:
        found.append(Check("run defaults / llama.cpp ms per token", ours / llama, DEFAULTS_VS_LLAMA_CPP_MAX, True))
    for (engine, setting), ms in by_key.items():
        generate = by_key.get(("transformers generate() + StaticCache", setting))
        if engine == "streamchat" and generate:
            name = f"streamchat / generate() ms per token, {setting}"
            found.append(Check(name, ms / generate, STREAMCHAT_VS_GENERATE_MAX, True))
    return found


def load_options(model: str | None, device: str, setting: Setting) -> LoadOptions:
    return LoadOptions(model=model, device=device, dtype=setting.dtype, quantize=setting.quantize)


def precision(loaded: LoadedModel) -> str:
    dtype = str(loaded.dtype).removeprefix("torch.")
    return dtype if loaded.quantization == "none" else f"{dtype} {loaded.quantization}"


def measure(
    model: str | None,
    device: str,
    defaults_setting: Setting,
    sizes: DecodeSizes,
    load: Callable[[LoadOptions], LoadedModel],
    note: Callable[[str], None],
) -> list[Row]:
    """Every row's median decode time over `sizes.trials` trials, the rows taking turns."""
    rows = contenders(defaults_setting)
    models: dict[str, LoadedModel] = {}
    for contender in rows:
        if contender.setting.label not in models:
            models[contender.setting.label] = load(load_options(model, device, contender.setting))
    first = models[defaults_setting.label]
    ids = prompt_ids(first)
    context = ids.shape[-1] + sizes.max_new_tokens // 2  # tokens cached at the reply's middle
    # (engine, setting label, seconds per decode step of one reply of the given size)
    runs: list[tuple[str, str, Callable[[DecodeSizes], float]]] = [
        (
            contender.name,
            contender.setting.label,
            lambda size, contender=contender: contender.decode(
                models[contender.setting.label], size, **contender.options
            ),
        )
        for contender in rows
    ]
    gguf, reason = llama_cpp_gguf(model)
    llama = None
    if gguf is None:
        note(reason)
    elif first.device.type != "cpu":
        note("llama.cpp row skipped: it runs here on the CPU only")
    else:
        llama = LlamaCpp(gguf, ids.shape[-1] + sizes.max_new_tokens + 8)
        prompt = ids[0].tolist()
        runs.append(
            ("llama.cpp", f"{gguf.name}, {torch.get_num_threads()} threads", lambda size: llama.decode(prompt, size))
        )
    # One short untimed reply each first: allocations, lazy imports and caches warm up outside the timing.
    warm_up = DecodeSizes(max_new_tokens=2, trials=1, window=sizes.window, sinks=sizes.sinks)
    for _, _, run in runs:
        run(warm_up)
    seconds: list[list[float]] = [[] for _ in runs]
    for trial in range(sizes.trials):
        # Who goes first rotates, so warm-up and bursts of load favour no row.
        order = list(range(len(runs)))
        order = order[trial % len(order) :] + order[: trial % len(order)]
        for index in order:
            seconds[index].append(runs[index][2](sizes))
    bandwidth = measure_bandwidth(first.device)
    found = []
    for (engine, label, _), measured in zip(runs, seconds, strict=True):
        if engine == "llama.cpp":
            limit = (gguf_bytes_per_token(gguf) + kv_bytes_per_token(first.model, context, 2)) / bandwidth
            found.append(row(engine, label, measured, limit))
            continue
        loaded = models[label]
        element = torch.finfo(loaded.dtype).bits // 8
        limit = (weight_bytes_per_token(loaded.model) + kv_bytes_per_token(loaded.model, context, element)) / bandwidth
        found.append(row(engine, label, measured, limit) | {"precision": precision(loaded)})
    return found
