"""`streamchat bench speed`: per-token decode latency and peak memory as a session grows.

One process, one model, three policies at the same cache fill:

- streaming: a session streams random tokens through the sink cache (in prefill chunks
  between checkpoints) and decodes at each checkpoint;
- dense: a DynamicCache holding as many tokens as the sink cache holds at that point;
- recompute: a sliding window recomputed for every token, over that many tokens.

At each checkpoint the policies take turns, one decode step each, `steps` times, in a
rotating order, so machine noise hits all alike; latencies are medians, memory the
peak of each policy's steps.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.generation.settings import GenerationSettings
from streamchat.measure.decoders import DenseDecoder, PolicyDecoder, RecomputeDecoder, StreamingDecoder
from streamchat.measure.memory import MemoryProbe, memory_probe
from streamchat.measure.report import Check, Column, Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
            recompute.start(stream[:, :fill], streaming.logits)
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
