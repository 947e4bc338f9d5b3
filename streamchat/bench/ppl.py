"""`streamchat bench ppl`: perplexity of a long text under four caching policies (the paper's Figure 3).

- dense: a full cache, positions growing with the text (the model's native behaviour);
- window: the same cache size without sinks (SinkCache with sinks=0);
- recompute: a sliding window recomputed from scratch for each chunk, the oracle;
- streaming: sinks + window through the sink cache;
- keep: what --keep system costs, a longer kept prefix (the first `longer_keep` tokens, a
  system turn's worth) through a cache of the same capacity as streaming's.

window, recompute and streaming read the text in the same chunks, so each of them
predicts a token from the same number of tokens (see perplexity.py); dense is exact at
any chunk size and reads larger ones.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.cache.ledger import SMALLEST_WINDOW
from streamchat.errors import ConfigError
from streamchat.measure.perplexity import OnScored, dense_nll, recompute_nll, streaming_nll
from streamchat.measure.report import Check, Column, Row

if TYPE_CHECKING:
    import torch
    from matplotlib.figure import Figure
    from rich.console import Console

# Dense sees every earlier token at any chunk size; big chunks copy its growing cache less often.
DENSE_CHUNK = 1024
# The claims a full run checks: streaming tracks the oracle, stays flat, and beats window attention.
STREAMING_VS_RECOMPUTE_MAX = 1.05
FLATNESS_MAX = 1.10
WINDOW_VS_STREAMING_MIN = 1.5
# Keeping a system turn's worth of first tokens may cost at most this much perplexity at the same capacity.
KEEP_VS_STREAMING_MAX = 1.05


@dataclass(frozen=True)
class PplSizes:
    """How much text, through which cache, in which chunks; and the spans the flatness check compares."""

    tokens: int
    sinks: int  # --keep: the first tokens streaming keeps
    window: int
    chunk: int
    # Flatness: perplexity over the last `tail` tokens against `reference_span`, a span just
    # inside the default model's 8192-token training context.
    reference_span: tuple[int, int]
    tail: int
    # Tokens per point of the perplexity curve.
    bucket: int
    # The keep policy's kept prefix; its window is what is left of the capacity.
    longer_keep: int = defaults.PPL_KEEP

    def __post_init__(self) -> None:
        require_at_least("--tokens", self.tokens, 2)
        require_at_least("--keep", self.sinks, 0)
        require_at_least("--window", self.window, SMALLEST_WINDOW)
        require_at_least("--chunk", self.chunk, 1)
        require_at_least("--longer-keep", self.longer_keep, 0)
        if self.chunk > self.window:
            raise ConfigError(f"--chunk {self.chunk}: a chunk must fit the window; use at most --window {self.window}")

    @property
    def capacity(self) -> int:
        return self.sinks + self.window

    @property
    def keep_window(self) -> int:
        """The keep policy's window: the same capacity as streaming's."""
        return self.capacity - self.longer_keep


FULL = PplSizes(
    tokens=defaults.PPL_TOKENS,
    sinks=defaults.PPL_SINKS,
    window=defaults.PPL_WINDOW,
    chunk=defaults.PPL_CHUNK,
    reference_span=(6000, 8000),
    tail=2000,
    bucket=256,
)
QUICK = PplSizes(
    tokens=384, sinks=4, window=60, chunk=16, reference_span=(128, 256), tail=128, bucket=32, longer_keep=16
)


def require_keep_fits(sizes: PplSizes) -> None:
    """The keep policy's window must hold a chunk (checked only when that policy runs)."""
    if sizes.chunk > sizes.keep_window:
        raise ConfigError(
            f"--longer-keep {sizes.longer_keep}: the {sizes.keep_window} tokens it leaves of the cache must hold "
            f"a --chunk of {sizes.chunk}; keep at most {sizes.capacity - sizes.chunk}, or leave keep out of --policies"
        )


def parse_policies(text: str | None) -> tuple[str, ...]:
    """Comma-separated policy names, in the table's order; None means all four."""
    if text is None:
        return defaults.BENCH_POLICIES
    names = {name.strip() for name in text.split(",") if name.strip()}
    unknown = sorted(names - set(defaults.BENCH_POLICIES))
    if unknown or not names:
        raise ConfigError(f"--policies {text!r}: choose from {', '.join(defaults.BENCH_POLICIES)}, separated by commas")
    return tuple(name for name in defaults.BENCH_POLICIES if name in names)


def read_text(path: Path, start_at: str | None = None) -> str:
    """A UTF-8 text file from the first `start_at` on, read before any model loads, so a bad path fails at once."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--text {path}: no such file; give a long plain-text file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"--text {path}: cannot be read as UTF-8 text ({error}); give a plain-text file") from None
    if start_at is None:
        return text
    start = text.find(start_at)
    if start < 0:
        raise ConfigError(f"--from {start_at!r}: not found in {path}; give a phrase the text contains")
    return text[start:]


def first_tokens(text: str, tokenizer: Any, tokens: int, device: Any) -> torch.Tensor:
    """The first `tokens` tokens of `text` as ids [1, tokens] on `device`."""
    ids = tokenizer(text, return_tensors="pt", verbose=False).input_ids[:, :tokens]
    if ids.shape[-1] < tokens:
        raise ConfigError(f"--text holds {ids.shape[-1]} tokens, fewer than --tokens {tokens}; lower --tokens")
    return ids.to(device)


@dataclass(frozen=True)
class PolicyRun:
    policy: str
    nll: torch.Tensor  # [tokens - 1] float64: nll[i] is the NLL of token i + 1
    seconds: float

    def ppl(self, start: int = 1, stop: int | None = None) -> float | None:
        """Perplexity of tokens [start, stop); None when the text does not reach that far."""
        stop = self.nll.shape[0] + 1 if stop is None else stop
        if not 1 <= start < stop <= self.nll.shape[0] + 1:
            return None
        return math.exp(self.nll[start - 1 : stop - 1].mean().item())


def run_policy(model: Any, ids: torch.Tensor, policy: str, sizes: PplSizes, on_scored: OnScored) -> PolicyRun:
    """Score the text under one policy and time it."""
    started = time.perf_counter()
    if policy == "dense":
        nll = dense_nll(model, ids, DENSE_CHUNK, on_scored)
    elif policy == "window":
        nll = streaming_nll(model, ids, 0, sizes.capacity, sizes.chunk, on_scored)
    elif policy == "recompute":
        nll = recompute_nll(model, ids, sizes.capacity, sizes.chunk, on_scored)
    elif policy == "keep":
        nll = streaming_nll(model, ids, sizes.longer_keep, sizes.keep_window, sizes.chunk, on_scored)
    else:
        nll = streaming_nll(model, ids, sizes.sinks, sizes.window, sizes.chunk, on_scored)
    return PolicyRun(policy, nll, time.perf_counter() - started)


def run_policies(
    model: Any, ids: torch.Tensor, policies: tuple[str, ...], sizes: PplSizes, console: Console
) -> list[PolicyRun]:
    """Score the text under each policy, with a progress bar on `console`; report each as it finishes."""
    runs = []
    columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=True) as progress:
        for policy in policies:
            task = progress.add_task(policy, total=ids.shape[-1] - 1)
            run = run_policy(model, ids, policy, sizes, functools.partial(progress.advance, task))
            progress.remove_task(task)
            progress.console.print(f"{policy:>9}: PPL {run.ppl():.2f} in {run.seconds:.1f} s")
            runs.append(run)
    return runs


def training_context_of(model: Any) -> int | None:
    """The context length the model was trained for, where its config says it."""
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


# ---- what the runs show ---------------------------------------------------------------------


def summary_columns(sizes: PplSizes) -> list[Column]:
    first, last = sizes.reference_span
    return [
        Column("policy", "policy"),
        Column("cache", "cache"),
        Column("tokens", "tokens", "{:,}"),
        Column("ppl", "PPL", "{:.2f}"),
        Column("ppl_reference", f"PPL {first}-{last}", "{:.2f}"),
        Column("ppl_tail", f"PPL last {sizes.tail}", "{:.2f}"),
        Column("tail_vs_reference", "last / ref", "{:.3f}"),
        Column("vs_recompute", "PPL / recompute", "{:.3f}"),
        Column("seconds", "wall s", "{:.1f}"),
        Column("tokens_per_second", "tok/s", "{:.0f}"),
    ]


def summary_rows(runs: list[PolicyRun], sizes: PplSizes) -> list[Row]:
    """One row per policy: final perplexity, the flatness spans, wall time."""
    recompute = next((run.ppl() for run in runs if run.policy == "recompute"), None)
    rows = []
    for run in runs:
        tokens = run.nll.shape[0] + 1
        reference, tail = run.ppl(*sizes.reference_span), run.ppl(tokens - sizes.tail)
        rows.append(
            {
                "policy": run.policy,
                "cache": _cache_label(run.policy, sizes),
                "tokens": tokens,
                "ppl": run.ppl(),
                "ppl_reference": reference,
                "ppl_tail": tail,
                "tail_vs_reference": _ratio(tail, reference),
                "vs_recompute": _ratio(run.ppl(), recompute),
                "seconds": run.seconds,
                "tokens_per_second": tokens / run.seconds if run.seconds > 0 else None,
            }
        )
    return rows


def curve_columns(runs: list[PolicyRun]) -> list[str]:
    return ["token", *(f"{run.policy}_{kind}" for run in runs for kind in ("ppl", "running_ppl"))]


def curve_rows(runs: list[PolicyRun], bucket: int) -> list[Row]:
    """Per bucket of tokens: each policy's perplexity over the bucket, and over everything so far."""
    scored = runs[0].nll.shape[0]
    ends = [*range(bucket, scored, bucket), scored]
    rows: list[Row] = [{"token": end} for end in ends]
    for run in runs:
        running = run.nll.cumsum(0)
        for row, start, end in zip(rows, [0, *ends[:-1]], ends, strict=True):
            # nll[end - 1] is the NLL of token `end`, the last of the bucket.
            row[f"{run.policy}_ppl"] = math.exp(run.nll[start:end].mean().item())
            row[f"{run.policy}_running_ppl"] = math.exp(running[end - 1].item() / end)
    return rows


def checks(rows: list[Row]) -> list[Check]:
    """The claims that the policies present can test."""
    by_policy = {row["policy"]: row for row in rows}
    streaming, recompute = by_policy.get("streaming"), by_policy.get("recompute")
    window, dense, keep = by_policy.get("window"), by_policy.get("dense"), by_policy.get("keep")
    found = []
    if streaming and recompute:
        ratio = streaming["ppl"] / recompute["ppl"]
        found.append(Check("streaming / recompute PPL", ratio, STREAMING_VS_RECOMPUTE_MAX, True))
    if streaming and streaming["tail_vs_reference"] is not None:
        found.append(Check("streaming flatness (last / ref PPL)", streaming["tail_vs_reference"], FLATNESS_MAX, True))
        if recompute:
            # Parts of a text differ in difficulty (a book's front matter is easy): against the
            # oracle's own last / ref ratio, only what the cache adds remains.
            drift = streaming["tail_vs_reference"] / recompute["tail_vs_reference"]
            found.append(Check("streaming flatness over recompute's (last / ref)", drift, FLATNESS_MAX, True))
    if window and streaming:
        found.append(Check("window / streaming PPL", window["ppl"] / streaming["ppl"], WINDOW_VS_STREAMING_MIN, False))
    if keep and streaming:
        name = f"keep {keep['cache'].split('+')[0]} / streaming PPL, same capacity"
        found.append(Check(name, keep["ppl"] / streaming["ppl"], KEEP_VS_STREAMING_MAX, True))
    if dense and dense["tail_vs_reference"] is not None:
        # Degrading means leaving the band streaming must stay in.
        found.append(Check("dense degradation (last / ref PPL)", dense["tail_vs_reference"], FLATNESS_MAX, False))
    return found


def draw_curves(runs: list[PolicyRun], sizes: PplSizes, training_context: int | None) -> Callable[[Figure], None]:
    """Figure 3 of the paper: perplexity along the text, per bucket and running, one line per policy."""

    def draw(figure: Figure) -> None:
        rows = curve_rows(runs, sizes.bucket)
        tokens = [row["token"] for row in rows]
        per_bucket, running = figure.subplots(1, 2, sharex=True)
        for axes, kind, title in (
            (per_bucket, "ppl", f"perplexity per {sizes.bucket} tokens"),
            (running, "running_ppl", "running perplexity"),
        ):
            for run in runs:
                axes.plot(tokens, [row[f"{run.policy}_{kind}"] for row in rows], label=_legend(run.policy, sizes))
            axes.set_yscale("log")
            axes.set_xlabel("tokens read")
            axes.set_title(title)
            axes.grid(True, which="both", alpha=0.3)
            if training_context and training_context < tokens[-1]:
                axes.axvline(training_context, color="grey", linestyle=":", label="training context")
        per_bucket.set_ylabel("perplexity (log scale)")
        running.legend()

    return draw


def _legend(policy: str, sizes: PplSizes) -> str:
    return f"{policy} ({_cache_label(policy, sizes)})"


def _cache_label(policy: str, sizes: PplSizes) -> str:
    return {
        "dense": "every token",
        "window": f"0+{sizes.capacity}",
        "recompute": f"{sizes.capacity}, recomputed",
        "streaming": f"{sizes.sinks}+{sizes.window}",
        "keep": f"{sizes.longer_keep}+{sizes.keep_window}",
    }[policy]


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator
