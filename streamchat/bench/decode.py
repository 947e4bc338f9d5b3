"""`streamchat bench decode`: decode speed of streamchat against its anchors, side by side in one run.

Same model, prompt and greedy decoding for every row:

- streamchat's token loop through the sink cache as `run` decodes (on a CPU, uncompiled,
  the engine's step with one row; else generation/decoder.py: draw, feed, read back),
  eager and with the decode step compiled, as `run` loads the model by default and as
  `--dtype float32 --quantize none` (the issue's CPU baseline: left out by --no-baseline, and where
  its weights, 4 bytes a parameter, would not fit in the memory available beside the model loaded);
- transformers' own generate() with a StaticCache on the same model: what a transformers
  user gets (decode time: from its first token to its last, as a streamer sees them); on CUDA generate()
  compiles the forward pass itself when the cache is static;
- llama.cpp (llama-cpp-python, when installed) on the same GGUF file;
- the memory-bandwidth limit: bytes read per token (weights, plus the KV cache at the
  reply's middle) over a bandwidth measured on the spot with one large GEMV.

Beside each streamchat row's ms/token: the aten operators one of its decode steps calls
(measure/aten_calls.py), counted after the timed trials.

A model is loaded (--model) or built from random weights in a known shape
(--random-init, no download: for GPU figures). --full-cache fills the cache to its
capacity before the reply, so every step reads the whole window, as in a long chat.
Trials rotate through the rows, so load from other processes hits all of them alike;
each row reports its median.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.markup import escape

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.cache import SinkCache
from streamchat.conversation.message import Message
from streamchat.generation.decoder import Decoder
from streamchat.generation.requests import endless_reply, read_prompt
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.measure.aten_calls import decode_aten_calls_per_token
from streamchat.measure.bandwidth import (
    cache_bytes_per_token,
    gguf_bytes_per_token,
    kv_bytes_per_token,
    measure_bandwidth,
    synchronize,
    weight_bytes_per_token,
)
from streamchat.measure.llama_cpp import LlamaCpp, llama_cpp_gguf
from streamchat.measure.report import Check, Column, Row
from streamchat.weights.footprint import available_memory

if TYPE_CHECKING:
    from streamchat.interface.config import RunConfig
    from streamchat.measure.models import ModelChoice

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
# The targets: on the CPU default model, and on CUDA (compiled against eager).
DEFAULTS_VS_FLOAT32_MIN = 2.5
DEFAULTS_VS_LLAMA_CPP_MAX = 2.5
STREAMCHAT_VS_GENERATE_MAX = 1.0
COMPILED_VS_EAGER_MIN = 2.5
COMPILED_VS_LIMIT_MAX = 2.0
STREAMCHAT, COMPILED, GENERATE = "streamchat", "streamchat compiled", "transformers generate() + StaticCache"


@dataclass(frozen=True)
class DecodeSizes:
    max_new_tokens: int  # tokens per reply; decode speed counts all but the first
    trials: int  # replies per row
    window: int = defaults.WINDOW
    sinks: int = defaults.SINKS
    full_cache: bool = False  # a prompt that fills the cache, so every step reads the whole window

    def __post_init__(self) -> None:
        require_at_least("--max-new-tokens", self.max_new_tokens, 2)
        require_at_least("--trials", self.trials, 1)


FULL = DecodeSizes(max_new_tokens=defaults.DECODE_BENCH_TOKENS, trials=defaults.DECODE_BENCH_TRIALS)
QUICK = DecodeSizes(max_new_tokens=6, trials=1, window=60)


@dataclass(frozen=True)
class Setting:
    """How a row's model is loaded: `run`'s own options."""

    label: str
    dtype: str
    quantize: str


@dataclass(frozen=True)
class Subject:
    """A model to decode with, the prompt every row starts from, and how its weights are stored."""

    model: Any
    ids: torch.Tensor  # [1, n]
    precision: str  # "bfloat16 int8", "float32"
    parameters: int  # counted before quantizing
    kv_cache: str = "full"  # how its caches store keys and values (--kv-cache as settled)

    @property
    def device(self) -> torch.device:
        return self.model.get_input_embeddings().weight.device


@dataclass(frozen=True)
class Contender:
    """One row: an engine decoding with a model loaded as `setting` says."""

    name: str
    setting: Setting
    # Seconds per decode step of one greedy reply of `max_new_tokens` tokens.
    decode: Callable[[Subject, DecodeSizes], float]


RUN_DEFAULTS = "run defaults"


def run_defaults(dtype: str, quantize: str) -> Setting:
    """`run`'s defaults, or the --dtype and --quantize the command was given, labelled by what was given."""
    options = (("dtype", dtype, defaults.DTYPE), ("quantize", quantize, defaults.QUANTIZE))
    given = [f"--{name} {value}" for name, value, default in options if value != default]
    return Setting(" ".join(given) or RUN_DEFAULTS, dtype, quantize)


BASELINE = Setting("--dtype float32 --quantize none", "float32", "none")
NOT_ASKED = "float32 rows left out: --no-baseline"


def baseline_left_out(parameters: int, available: int | None) -> str | None:
    """Why the float32 rows are left out where their weights (4 bytes a parameter) exceed the `available` bytes;
    None where they fit, or where the memory available is unknown."""
    needed = 4 * parameters
    if available is None or needed <= available:
        return None
    return f"float32 rows left out: their weights need {needed / 1e9:.1f} GB, {available / 1e9:.1f} GB is available"


def contenders(defaults_setting: Setting, device_type: str, compiled: bool) -> list[Contender]:
    """The rows, in table order: each is one entry."""
    rows = [Contender(STREAMCHAT, defaults_setting, streamchat_decode)]
    if compiled:
        rows.append(Contender(COMPILED, defaults_setting, compiled_decode))
    rows.append(Contender(GENERATE, defaults_setting, generate_decode))
    if device_type == "cpu" and (defaults_setting.dtype, defaults_setting.quantize) != ("float32", "none"):
        rows.append(Contender(STREAMCHAT, BASELINE, streamchat_decode))
        rows.append(Contender(GENERATE, BASELINE, generate_decode))
    return rows


# ---- the engines --------------------------------------------------------------------------------


def streamchat_decode(subject: Subject, sizes: DecodeSizes, compile_backend: str | None = None) -> float:
    """Seconds per decode step of streamchat's token loop as `run` decodes, greedy, after the prompt (read as the
    chat reads one): the engine's step, one row (compiled with `compile_backend`)."""
    model = subject.model
    cache = SinkCache.for_model(model, sizes.sinks, sizes.window)
    decoder = Decoder(cache)
    logits = read_prompt(model, cache, subject.ids[0].tolist())
    decoder.start(logits, GenerationSettings(temperature=0.0), Sampler(0))
    next_token = endless_reply(model, decoder, compile_backend)
    next_token()  # the first step: it compiles, when compiling
    synchronize(subject.device)
    started = time.perf_counter()
    for _ in range(sizes.max_new_tokens - 1):
        next_token()
    synchronize(subject.device)
    return (time.perf_counter() - started) / (sizes.max_new_tokens - 1)


def compiled_decode(subject: Subject, sizes: DecodeSizes) -> float:
    return streamchat_decode(subject, sizes, compile_backend="inductor")


def generate_decode(subject: Subject, sizes: DecodeSizes) -> float:
    """Seconds per decode step of generate() with a StaticCache: from its first generated token to its last, as a
    streamer sees them come (subtracting a 1-token run's time instead left the prompt's read in the figure, noise
    that made a 16-token reply of a 1.7B model negative)."""
    from transformers.generation.streamers import BaseStreamer

    class Arrivals(BaseStreamer):
        """When generate() handed over the prompt, then each new token (read back to the host: synchronized)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value: torch.Tensor) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    arrivals = Arrivals()
    with torch.inference_mode():
        subject.model.generate(
            subject.ids,
            attention_mask=torch.ones_like(subject.ids),
            max_new_tokens=sizes.max_new_tokens,
            min_new_tokens=sizes.max_new_tokens,
            do_sample=False,
            cache_implementation="static",
            pad_token_id=0,
            streamer=arrivals,
        )
    first, last = arrivals.times[1], arrivals.times[-1]  # times[0]: the prompt
    return (last - first) / (sizes.max_new_tokens - 1)


def prompt_ids(tokenizer: Any, device: torch.device) -> torch.Tensor:
    """The chat prompt as the model's template renders it: ids [1, n]."""
    messages: list[Message] = [{"role": "user", "content": PROMPT}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, return_tensors="pt", add_special_tokens=False).input_ids.to(device)


def subject(choice: ModelChoice, config: RunConfig, setting: Setting, sizes: DecodeSizes) -> Subject:
    """The model loaded as `setting` asks, and the chat prompt; or (--full-cache, or random weights, which have no
    tokenizer) a prompt that fills the cache."""
    loaded = choice.bench_model(dataclasses.replace(config, dtype=setting.dtype, quantize=setting.quantize))
    if sizes.full_cache or loaded.tokenizer is None:
        ids = filling_ids(loaded.model, sizes)
    else:
        ids = prompt_ids(loaded.tokenizer, loaded.device)
    return Subject(loaded.model, ids, loaded.precision, loaded.parameters, loaded.kv_cache)


def llama_cpp_file(model: str, random_init: str | None, device_type: str, say: Callable[[str], None]) -> Path | None:
    """The GGUF file of the llama.cpp row: --model's, on a CPU; None (`say` why, where there could be one)."""
    if random_init is not None or device_type != "cpu":
        return None
    gguf, reason = llama_cpp_gguf(model)
    if gguf is None:
        say(reason)
    return gguf


def filling_ids(model: Any, sizes: DecodeSizes) -> torch.Tensor:
    """Random ids [1, capacity]: a prompt that leaves the cache full when the reply starts."""
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    return torch.randint(vocab, (1, sizes.sinks + sizes.window), generator=generator).to(
        model.get_input_embeddings().weight.device
    )


# ---- rows, checks -------------------------------------------------------------------------------


def columns() -> list[Column]:
    return [
        Column("engine", "engine"),
        Column("setting", "model loaded as"),
        Column("precision", "precision"),
        Column("kv_cache", "KV cache"),
        Column("kv_mb_per_token", "KV MB/token", "{:.1f}"),
        Column("ms_per_token", "ms/token", "{:.1f}"),
        Column("aten_calls_per_token", "aten calls/token"),
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


def title(name: str, device_type: str, sizes: DecodeSizes) -> str:
    return (
        f"Decode speed: {escape(name)} on {device_type}, greedy, {sizes.max_new_tokens} tokens per reply, "
        f"cache {sizes.sinks}+{sizes.window}{' full' if sizes.full_cache else ''}, median of {sizes.trials}"
    )


def caption(left_out: str | None) -> str:
    """What the limit is, and why the float32 rows are left out where they are."""
    limit = "limit: (weight bytes + KV-cache bytes read per token) / bandwidth of one large GEMV, measured now"
    return f"{limit}\n{escape(left_out)}" if left_out else limit


def checks(rows: list[Row], defaults_setting: str, device_type: str) -> list[Check]:
    by_key = {(r["engine"], r["setting"]): r for r in rows}

    def ms(engine: str, setting: str) -> float | None:
        found = by_key.get((engine, setting))
        return found["ms_per_token"] if found else None

    found = []
    ours, baseline = ms(STREAMCHAT, defaults_setting), ms(STREAMCHAT, BASELINE.label)
    if device_type == "cpu" and ours and baseline and defaults_setting != BASELINE.label:
        speedup = Check(f"{defaults_setting} / float32 decode speed", baseline / ours, DEFAULTS_VS_FLOAT32_MIN, False)
        found.append(speedup)
    llama = next((r["ms_per_token"] for r in rows if r["engine"] == "llama.cpp"), None)
    if ours and llama:
        against_llama = Check(
            f"{defaults_setting} / llama.cpp ms per token", ours / llama, DEFAULTS_VS_LLAMA_CPP_MAX, True
        )
        found.append(against_llama)
    compiled = by_key.get((COMPILED, defaults_setting))
    if device_type == "cuda" and compiled and ours:
        found.append(
            Check("compiled / eager decode speed", ours / compiled["ms_per_token"], COMPILED_VS_EAGER_MIN, False)
        )
        found.append(Check("compiled ms per token / the limit", compiled["x_of_limit"], COMPILED_VS_LIMIT_MAX, True))
    for (engine, setting), measured in by_key.items():
        generate = ms(GENERATE, setting)
        if engine in (STREAMCHAT, COMPILED) and generate:
            name = f"{engine} / generate() ms per token, {setting}"
            found.append(Check(name, measured["ms_per_token"] / generate, STREAMCHAT_VS_GENERATE_MAX, True))
    return found


def measure(
    defaults_setting: Setting,
    sizes: DecodeSizes,
    subject_for: Callable[[Setting], Subject],
    device_type: str,
    compiled: bool,
    gguf: Path | None,
    baseline: bool = True,
) -> tuple[list[Row], str | None]:
    """Every row's median decode time over `sizes.trials` trials, the rows taking turns; and why the float32
    rows are left out (None where they run or have no place)."""
    rows = contenders(defaults_setting, device_type, compiled)
    subjects = {defaults_setting.label: subject_for(defaults_setting)}
    left_out = None
    if any(contender.setting == BASELINE for contender in rows):
        # Judged with the first model loaded, which stays loaded beside the float32 one.
        parameters = subjects[defaults_setting.label].parameters
        left_out = baseline_left_out(parameters, available_memory()) if baseline else NOT_ASKED
        if left_out is not None:
            rows = [contender for contender in rows if contender.setting != BASELINE]
    for contender in rows:
        if contender.setting.label not in subjects:
            subjects[contender.setting.label] = subject_for(contender.setting)
    first = subjects[defaults_setting.label]
    context = first.ids.shape[-1] + sizes.max_new_tokens // 2  # tokens cached at the reply's middle
    context = min(context, sizes.sinks + sizes.window)
    # (engine, setting label, seconds per decode step of one reply of the given size)
    runs: list[tuple[str, str, Callable[[DecodeSizes], float]]] = [
        (
            contender.name,
            contender.setting.label,
            functools.partial(contender.decode, subjects[contender.setting.label]),
        )
        for contender in rows
    ]
    if gguf is not None:
        llama = LlamaCpp(gguf, first.ids.shape[-1] + sizes.max_new_tokens + 8, torch.get_num_threads())
        prompt = first.ids[0].tolist()
        label = f"{gguf.name}, {torch.get_num_threads()} threads"
        runs.append(("llama.cpp", label, lambda size: llama.decode(prompt, size.max_new_tokens)))
    # One short untimed reply each first: allocations, lazy imports, compiling, caches warm up untimed.
    warm_up = DecodeSizes(2, 1, sizes.window, sizes.sinks, sizes.full_cache)
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
    # Compiled rows compiled their step in the warm-up; counting compiles it once more, untimed.
    backends = {STREAMCHAT: None, COMPILED: "inductor"}
    calls = {
        (contender.name, contender.setting.label): decode_aten_calls_per_token(
            subjects[contender.setting.label].model,
            subjects[contender.setting.label].ids,
            sizes.sinks,
            sizes.window,
            backends[contender.name],
        )
        for contender in rows
        if contender.name in backends
    }
    found = []
    for (engine, label, _), measured in zip(runs, seconds, strict=True):
        if engine == "llama.cpp" and gguf is not None:  # its row is there only with a GGUF
            limit = (gguf_bytes_per_token(gguf) + kv_bytes_per_token(first.model, context, 2)) / bandwidth
            found.append(row(engine, label, measured, limit))
            continue
        subject = subjects[label]
        kv_format = "full" if engine == GENERATE else subject.kv_cache  # generate() keeps its StaticCache
        kv_bytes = cache_bytes_per_token(subject.model, context, kv_format)
        limit = (weight_bytes_per_token(subject.model) + kv_bytes) / bandwidth
        found.append(
            row(engine, label, measured, limit)
            | {
                "precision": subject.precision,
                "aten_calls_per_token": calls.get((engine, label)),
                "kv_cache": kv_format,
                "kv_mb_per_token": kv_bytes / 1e6,
            }
        )
    return found, left_out
