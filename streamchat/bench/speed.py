"""`streamchat bench speed`: per-token decode latency and peak memory as a session grows.

One process, one model, three policies at the same cache fill:

- streaming: a session streams random tokens through the sink cache (in prefill chunks
  between checkpoints) and decodes at each checkpoint;
- dense: a DynamicCache holding as many tokens as the sink cache holds at that point;
- recompute: a sliding window recomputed for every token, over that many tokens.

At each checkpoint the policies take turns, one decode step each, `steps` times, in a
rotating order, so machine noise hits all alike; latencies are medians, memory the
peak of each policy's steps.

With --tp N: decode ms/token of one reply with the model sharded over N processes, against one.
Outside torchrun, the command first measures one process (the whole model here), then
starts N ranks (streamchat.distributed.supervisor) that measure the same reply together:
greedy, `steps` tokens after a warm-up reply, through the chat's own lockstep (rank 0
draws and broadcasts each token). Under torchrun only the N-process figure is printed.
On one CPU the processes share its cores: a smoke test, not a scaling figure.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.config import load_options
from streamchat.loading import LoadedModel, LoadOptions
from streamchat.measure.decoders import DenseDecoder, PolicyDecoder, RecomputeDecoder, StreamingDecoder
from streamchat.measure.memory import MemoryProbe, memory_probe
from streamchat.measure.report import Check, Column, Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from streamchat.measure.models import ModelChoice

POLICIES = ("streaming", "dense", "recompute")
# The claims a full run checks: streaming costs what dense costs at the same fill, far less than
# recomputation (22.2x: the paper's Figure 10), and its memory stays flat once the cache is full.
STREAMING_VS_DENSE_MAX = 1.05
RECOMPUTE_VS_STREAMING_MIN = 22.2
MEMORY_GROWTH_MAX_PERCENT = 1.0
# Memory growth is measured from the first checkpoint at or past this many tokens (the cache
# long full, the allocator settled), to the last.
MEMORY_BASELINE_TOKENS = 10_000
# Random token ids from a fixed seed: timing does not depend on what the tokens say.
STREAM_SEED = 0
MIB = 2**20
# --tp: the reply timed, and the untimed one before it.
TP_PROMPT = "Tell me a long story about a lighthouse keeper."
TP_WARMUP_TOKENS = 8


@dataclass(frozen=True)
class SpeedSizes:
    sinks: int
    window: int
    checkpoints: tuple[int, ...]  # tokens streamed before each measurement
    steps: int  # decode steps timed per policy at each checkpoint

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ConfigError(f"--keep {self.sinks} --window {self.window}: need keep >= 0 and window >= 1")
        if self.steps < 1:
            raise ConfigError(f"--steps {self.steps}: must be at least 1")
        if not self.checkpoints or self.checkpoints[0] < 1 or list(self.checkpoints) != sorted(set(self.checkpoints)):
            raise ConfigError(
                f"--checkpoints {','.join(map(str, self.checkpoints))}: give increasing token counts, e.g. 1000,2000"
            )

    @property
    def capacity(self) -> int:
        return self.sinks + self.window


FULL = SpeedSizes(defaults.SINKS, defaults.WINDOW, defaults.SPEED_CHECKPOINTS, defaults.SPEED_STEPS)
QUICK = SpeedSizes(sinks=4, window=60, checkpoints=(64, 128, 256), steps=3)


def parse_checkpoints(text: str | None) -> tuple[int, ...] | None:
    """ "1000,2000,4000" -> (1000, 2000, 4000); None stays None (the default)."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise ConfigError(f"--checkpoints {text!r}: give whole numbers separated by commas, e.g. 1000,2000") from None


@dataclass(frozen=True)
class Measurement:
    """One checkpoint: per policy, the median step latency (s) and the peak memory of its steps (bytes)."""

    streamed: int  # tokens the streaming session had taken in when its steps began
    fill: int  # tokens in every policy's context (the sink cache's fill)
    latency: dict[str, float]
    peak_memory: dict[str, int]


def run_speed(
    model: Any,
    sizes: SpeedSizes,
    settings: GenerationSettings | None = None,
    on_measurement: Callable[[Measurement], None] | None = None,
) -> tuple[list[Measurement], str]:
    """Measure every checkpoint; return the measurements and what the memory numbers are.

    `settings`: how each step samples; None: as the chat would, from the model's generation config.
    """
    if settings is None:
        settings = GenerationSettings.from_generation_config(getattr(model, "generation_config", None))
    device = model.get_input_embeddings().weight.device
    probe = memory_probe(device)
    streaming = StreamingDecoder(model, sizes.sinks, sizes.window, settings, STREAM_SEED)
    dense = DenseDecoder(model, settings, STREAM_SEED)
    recompute = RecomputeDecoder(model, settings, STREAM_SEED)
    decoders: dict[str, PolicyDecoder] = {"streaming": streaming, "dense": dense, "recompute": recompute}
    stream = _random_stream(model, sizes.checkpoints[-1], device)
    measurements = []
    with torch.inference_mode():
        for checkpoint in sizes.checkpoints:
            _stream_to(streaming, stream, checkpoint)
            streamed, fill = streaming.seen, streaming.fill
            # Which tokens the other two hold does not change their cost: the stream's first `fill`.
            dense.extend(stream[:, dense.fill : fill])
            recompute.start(stream[:, :fill], streaming.last_logits())
            latency, peak_memory = _time_steps(decoders, sizes.steps, probe, device)
            measurement = Measurement(streamed, fill, latency, peak_memory)
            measurements.append(measurement)
            if on_measurement is not None:
                on_measurement(measurement)
    return measurements, probe.kind


def _random_stream(model: Any, length: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(STREAM_SEED)
    return torch.randint(model.config.get_text_config().vocab_size, (1, length), generator=generator).to(device)


def _stream_to(streaming: StreamingDecoder, stream: torch.Tensor, checkpoint: int) -> None:
    """Feed the stream until the session has taken in `checkpoint` tokens (decoded ones count)."""
    if streaming.seen < checkpoint:
        streaming.feed(stream[:, streaming.seen : checkpoint])


def _time_steps(
    decoders: dict[str, PolicyDecoder], steps: int, probe: MemoryProbe, device: torch.device
) -> tuple[dict[str, float], dict[str, int]]:
    """Median latency and peak memory of `steps` decode steps per policy, the policies taking turns."""
    names = list(decoders)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    peaks = dict.fromkeys(names, 0)
    for step in range(steps):
        # Rotate who goes first, so that no policy always runs right after the same other one.
        turn = step % len(names)
        for name in names[turn:] + names[:turn]:
            probe.reset()
            _synchronize(device)
            started = time.perf_counter()
            decoders[name].step()
            _synchronize(device)
            seconds[name].append(time.perf_counter() - started)
            peaks[name] = max(peaks[name], probe.peak())
            decoders[name].rewind()
    return {name: statistics.median(values) for name, values in seconds.items()}, peaks


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


# ---- what the measurements show ------------------------------------------------------------


def describe(measurement: Measurement) -> str:
    """One progress line: each policy's latency at this checkpoint."""
    latency = ", ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in measurement.latency.items())
    return f"{measurement.streamed:>8,} tokens streamed: {latency}"


def caption(memory_kind: str) -> str:
    return f"ms: median decode latency per token; MiB: {memory_kind} during each policy's steps"


def columns() -> list[Column]:
    return [
        Column("streamed", "streamed", "{:,}"),
        Column("fill", "fill", "{:,}"),
        *(Column(f"{policy}_ms", f"{policy} ms", "{:.1f}") for policy in POLICIES),
        Column("streaming_vs_dense", "stream/dense", "{:.3f}"),
        Column("recompute_vs_streaming", "recomp/stream", "{:.1f}"),
        *(Column(f"{policy}_mib", f"{policy} MiB", "{:,.0f}") for policy in POLICIES),
    ]


def rows(measurements: list[Measurement]) -> list[Row]:
    found = []
    for measurement in measurements:
        latency = measurement.latency
        row: Row = {"streamed": measurement.streamed, "fill": measurement.fill}
        row |= {f"{policy}_ms": latency[policy] * 1000 for policy in POLICIES}
        row["streaming_vs_dense"] = latency["streaming"] / latency["dense"]
        row["recompute_vs_streaming"] = latency["recompute"] / latency["streaming"]
        row |= {f"{policy}_mib": measurement.peak_memory[policy] / MIB for policy in POLICIES}
        found.append(row)
    return found


def checks(measurements: list[Measurement], sizes: SpeedSizes) -> list[Check]:
    """The claims, judged at the checkpoints where the sink cache is full."""
    full = [row for row in rows(measurements) if row["fill"] == sizes.capacity]
    if not full:
        return []
    found = [
        Check(
            "streaming / dense latency, full cache (worst)",
            max(r["streaming_vs_dense"] for r in full),
            STREAMING_VS_DENSE_MAX,
            True,
        ),
        Check(
            f"recompute / streaming latency, cache {sizes.capacity} (worst)",
            min(r["recompute_vs_streaming"] for r in full),
            RECOMPUTE_VS_STREAMING_MIN,
            False,
        ),
    ]
    baseline = next((r for r in full if r["streamed"] >= MEMORY_BASELINE_TOKENS), full[0])
    last = full[-1]
    if last is not baseline:
        growth = 100 * (last["streaming_mib"] / baseline["streaming_mib"] - 1)
        name = f"streaming memory growth % from {baseline['streamed']:,} to {last['streamed']:,} tokens"
        found.append(Check(name, growth, MEMORY_GROWTH_MAX_PERCENT, True))
    return found


def draw_speed(measurements: list[Measurement], sizes: SpeedSizes, memory_kind: str) -> Callable[[Figure], None]:
    """Latency and memory against tokens streamed, one line per policy."""

    def draw(figure: Figure) -> None:
        shown = rows(measurements)
        streamed = [row["streamed"] for row in shown]
        latency, memory = figure.subplots(1, 2, sharex=True)
        for policy in POLICIES:
            latency.plot(streamed, [row[f"{policy}_ms"] for row in shown], marker="o", label=policy)
            memory.plot(streamed, [row[f"{policy}_mib"] for row in shown], marker="o", label=policy)
        latency.set_yscale("log")
        latency.set_ylabel("ms per token (log scale)")
        latency.set_title(f"decode latency, cache {sizes.sinks}+{sizes.window}")
        memory.set_ylabel("MiB")
        memory.set_title(memory_kind)
        for axes in (latency, memory):
            axes.set_xscale("log")
            axes.set_xticks(streamed, [_thousands(count) for count in streamed])
            axes.minorticks_off()
            axes.set_xlabel("tokens streamed")
            axes.axvline(sizes.capacity, color="grey", linestyle=":", label="cache full")
            axes.grid(True, which="both", alpha=0.3)
        latency.legend()

    return draw


def _thousands(count: int) -> str:
    """64000 -> "64k": checkpoint labels that fit side by side on a log axis."""
    return f"{count / 1000:g}k" if count >= 1000 else str(count)


# ---- --tp N: one reply's decode speed, the model sharded over N processes ----------------------


@dataclass(frozen=True)
class DecodeSpeed:
    processes: int
    backend: str  # "one process", "gloo" or "nccl"
    device: str
    tokens: int  # decode steps timed
    ms_per_token: float

    def line(self) -> str:
        how = "1 process" if self.processes == 1 else f"{self.processes} processes ({self.backend})"
        return f"decode {self.ms_per_token:.2f} ms/token · {how} on {self.device} · {self.tokens} tokens"


def tp_speed(
    world_size: str, choice: ModelChoice, window: int | None, steps: int | None, say: Callable[[str], None]
) -> int:
    """Measure one process, then `world_size` (or join torchrun's ranks and measure those); the exit code."""
    from streamchat.distributed.group import ranks_from_env
    from streamchat.loading import load_model

    options = load_options(choice.config())
    if choice.random_init is not None:
        raise ConfigError("--tp loads --model's weights sharded: give --model instead of --random-init")
    options = dataclasses.replace(options, quantize="none")  # --tp shards unquantized weights
    window, steps = window or defaults.WINDOW, steps or defaults.TP_BENCH_STEPS
    ranks = ranks_from_env(os.environ)
    if ranks is None:
        if not world_size.isdigit() or int(world_size) < 2:
            raise ConfigError(f"--tp {world_size}: give the number of processes (2 or more) to measure")
        say(measure_reply(load_model(options), window, steps).line())
        from streamchat.distributed.supervisor import supervise

        return supervise(int(world_size), [sys.executable, "-m", "streamchat", *sys.argv[1:]], say)
    return _as_rank(ranks, options, window, steps, say)


def _as_rank(ranks: Any, options: LoadOptions, window: int, steps: int, say: Callable[[str], None]) -> NoReturn:
    from streamchat.distributed.follower import follow
    from streamchat.distributed.group import device_type, join_group, leave_group_and_exit, step_timeout
    from streamchat.distributed.leader import LeaderSession
    from streamchat.distributed.lockstep import Lockstep
    from streamchat.loading import load_model

    where = device_type(options.device, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    group = join_group(ranks, where, step_timeout(os.environ))
    lockstep = Lockstep(group)
    loaded = load_model(dataclasses.replace(options, tp_size=ranks.world_size))
    session = _session(loaded, window, steps, lockstep)
    if not ranks.leads:
        follow(session, lockstep)
        leave_group_and_exit(0)
    leader = LeaderSession(session.session, session.driver, lockstep)
    try:
        speed = measure_reply(loaded, window, steps, leader)
    finally:
        leader.close()
    backend = "nccl" if where == "cuda" else "gloo"
    say(dataclasses.replace(speed, processes=ranks.world_size, backend=backend).line())
    leave_group_and_exit(0)  # only after a clean end (see app/tensor_parallel.py)


def _session(loaded: LoadedModel, window: int, steps: int, channel: Any = None) -> Any:
    from streamchat.conversation.driven import driven_session
    from streamchat.conversation.session_options import SessionOptions

    settings = GenerationSettings(max_new_tokens=steps + 1, temperature=0.0, stop=())
    return driven_session(
        loaded.model, loaded.tokenizer, SessionOptions(window=window, settings=settings, channel=channel, recall="off")
    )


def measure_reply(loaded: LoadedModel, window: int, steps: int, session: Any = None) -> DecodeSpeed:
    """A warm-up reply, then a timed one of `steps` decode steps (fewer if the model ends it)."""
    session = session or _session(loaded, window, steps)
    session.update_settings(max_new_tokens=TP_WARMUP_TOKENS)
    _finished(session.chat(TP_PROMPT))
    session.update_settings(max_new_tokens=steps + 1)  # the first token comes from the prompt's logits
    stats = _finished(session.chat(TP_PROMPT)).stats
    tokens = stats.generated_tokens - 1
    per_token = 1000 * stats.decode_seconds / tokens if tokens > 0 else float("nan")
    return DecodeSpeed(1, "one process", str(loaded.device), tokens, per_token)


def _finished(events: Any) -> TurnFinished:
    finished = None
    for event in events:
        if isinstance(event, TurnFinished):
            finished = event
    if finished is None:
        raise ConfigError("a reply ended without finishing")
    return finished
