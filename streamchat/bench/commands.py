"""`streamchat bench ppl|speed|display`: the Typer sub-app (mounted by streamchat.app.cli as `bench`).

Each command prints a table and the target checks, and writes CSV files and a PNG plot
into --out. torch, transformers and matplotlib load only once a command runs.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from streamchat import defaults
from streamchat.app.errors import reported_errors, stderr
from streamchat.bench.report import MATPLOTLIB_MISSING, Check, Column, print_report, save_plot, write_csv
from streamchat.errors import ConfigError, OutOfMemoryError

if TYPE_CHECKING:
    import torch

    from streamchat.bench.models import BenchModel
    from streamchat.bench.ppl import PolicyRun, PplSizes
    from streamchat.loading import LoadedModel

bench_app = typer.Typer(
    name="bench",
    help="Benchmarks that reproduce the StreamingLLM paper's claims: perplexity and decode speed.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="An alias, hub id, model directory or .gguf file (see `streamchat models`). Default: SmolLM2-135M.",
        show_default=False,
    ),
]
DeviceOption = Annotated[str, typer.Option(metavar=f"[{'|'.join(defaults.DEVICES)}]", help="Where the model runs.")]
DtypeOption = Annotated[str, typer.Option(metavar=f"[{'|'.join(defaults.DTYPES)}]", help="Weight precision.")]
OutOption = Annotated[Path, typer.Option("--out", help="Directory for the CSV files and the plot.")]
QuickOption = Annotated[
    bool, typer.Option("--quick", help="Toy sizes that finish in seconds; options given still apply. A smoke test.")
]


def _size(help_text: str, default: object) -> Any:
    """An option that falls back to the full size (or the --quick one) when not given."""
    return typer.Option(help=f"{help_text} \\[default: {default}]", show_default=False)


SINKS_HELP = "Attention sinks kept forever."
WINDOW_HELP = "Recent tokens kept in the rolling window."


@bench_app.command()
def ppl(
    text: Annotated[Path, typer.Option(help="A long UTF-8 text, e.g. a Gutenberg novel.", show_default=False)],
    start_at: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Start scoring where this text first appears (skip a book's front matter).",
            show_default=False,
        ),
    ] = None,
    tokens: Annotated[int | None, _size("Tokens of the text to score.", defaults.PPL_TOKENS)] = None,
    sinks: Annotated[int | None, _size(SINKS_HELP, defaults.PPL_SINKS)] = None,
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.PPL_WINDOW)] = None,
    chunk: Annotated[
        int | None, _size("Tokens per forward pass for window, recompute and streaming.", defaults.PPL_CHUNK)
    ] = None,
    policies: Annotated[str | None, _size(f"Comma-separated, from {','.join(defaults.BENCH_POLICIES)}.", "all")] = None,
    model: ModelOption = None,
    device: DeviceOption = defaults.DEVICE,
    dtype: DtypeOption = defaults.DTYPE,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """Perplexity of a long text under dense, window, recompute and streaming caches (the paper's Figure 3).

    Defaults: the paper's cache of 4 sinks + 1020 window tokens over 20,000 tokens.
    """
    from streamchat.bench import ppl as bench

    with reported_errors():
        sizes = bench.sizes_for(quick, tokens=tokens, sinks=sinks, window=window, chunk=chunk)
        chosen = bench.parse_policies(policies)
        content = bench.read_text(text, start_at)
        loaded = _load(model, device, dtype)
        ids = bench.first_tokens(content, loaded.tokenizer, sizes.tokens, loaded.device)
        with _memory_errors():
            runs = _score(loaded.model, ids, chosen, sizes)
        rows = bench.summary_rows(runs, sizes)
        title = (
            f"Perplexity: {escape(loaded.source.name)} on {escape(text.name)}, {sizes.tokens:,} tokens, "
            f"cache {sizes.sinks}+{sizes.window}, chunk {sizes.chunk} (dense {bench.DENSE_CHUNK})"
        )
        print_report(_stdout(), title, bench.summary_columns(sizes), rows, bench.checks(rows))
        training_context = getattr(loaded.model.config.get_text_config(), "max_position_embeddings", None)
        _save(
            out,
            {
                "ppl.csv": ([column.key for column in bench.summary_columns(sizes)], rows),
                "ppl-curve.csv": (bench.curve_columns(runs), bench.curve_rows(runs, sizes.bucket)),
            },
            "ppl.png",
            bench.draw_curves(runs, sizes, training_context),
        )


@bench_app.command()
def speed(
    model: ModelOption = None,
    random_init: Annotated[
        str | None,
        typer.Option(
            "--random-init",
            metavar="CONFIG",
            help="Random weights in a known shape instead of --model: a preset (llama-2-7b, llama-2-13b, "
            "smollm2-135m, tiny), a config.json, or a transformers model type. No download.",
            show_default=False,
        ),
    ] = None,
    sinks: Annotated[int | None, _size(SINKS_HELP, defaults.SINKS)] = None,
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.WINDOW)] = None,
    checkpoints: Annotated[
        str | None,
        _size(
            "Tokens streamed before each measurement, comma-separated.",
            ",".join(map(str, defaults.SPEED_CHECKPOINTS)),
        ),
    ] = None,
    steps: Annotated[
        int | None, _size("Decode steps timed per policy at each checkpoint.", defaults.SPEED_STEPS)
    ] = None,
    device: DeviceOption = defaults.DEVICE,
    dtype: DtypeOption = defaults.DTYPE,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """Per-token decode latency and peak memory of streaming, dense and recompute, as a session grows.

    Defaults: the chat's cache (4 + 2000), 64,000 tokens streamed, all three policies at the same fill.
    """
    from streamchat.bench import speed as bench
    from streamchat.engine.settings import GenerationSettings

    with reported_errors():
        sizes = bench.sizes_for(
            quick, sinks=sinks, window=window, checkpoints=bench.parse_checkpoints(checkpoints), steps=steps
        )
        chosen = _bench_model(model, random_init, device, dtype)
        settings = GenerationSettings.from_generation_config(getattr(chosen.model, "generation_config", None))

        def show(measurement: bench.Measurement) -> None:
            latency = ", ".join(f"{name} {seconds * 1000:.1f} ms" for name, seconds in measurement.latency.items())
            stderr.print(f"{measurement.streamed:>8,} tokens streamed: {latency}")

        with _memory_errors():
            measurements, memory_kind = bench.run_speed(chosen.model, sizes, settings, show)
        dtype_name = str(chosen.dtype).removeprefix("torch.")
        title = (
            f"Decode speed: {escape(chosen.name)} on {chosen.device.type} ({dtype_name}), "
            f"cache {sizes.sinks}+{sizes.window}, median of {sizes.steps} steps"
        )
        columns = bench.columns()
        rows = bench.rows(measurements)
        caption = f"ms: median decode latency per token; MiB: {memory_kind} during each policy's steps"
        print_report(_stdout(), title, columns, rows, bench.checks(measurements, sizes), caption)
        _save(
            out,
            {"speed.csv": ([column.key for column in columns], rows)},
            "speed.png",
            bench.draw_speed(measurements, sizes, memory_kind),
        )


@bench_app.command()
def display(
    model: ModelOption = None,
    trials: Annotated[int, typer.Option(help="Replies per side (the median counts).")] = 5,
    max_new_tokens: Annotated[int, typer.Option(help="Tokens per reply.")] = 96,
    window: Annotated[int, typer.Option(help=WINDOW_HELP)] = defaults.WINDOW,
    device: DeviceOption = defaults.DEVICE,
    dtype: DtypeOption = defaults.DTYPE,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
) -> None:
    """Decode speed of the chat app (live Rich display) against the engine alone, side by side."""
    from streamchat.bench.display_overhead import APP_VS_ENGINE_MIN, measure_display_overhead

    with reported_errors():
        if trials < 1 or max_new_tokens < 2:
            raise ConfigError("--trials must be at least 1 and --max-new-tokens at least 2")
        loaded = _load(model, device, dtype)
        with _memory_errors():
            result = measure_display_overhead(
                loaded.model,
                loaded.tokenizer,
                trials=trials,
                max_new_tokens=max_new_tokens,
                sinks=defaults.SINKS,
                window=window,
            )
        columns = [
            Column("trial", "trial"),
            Column("engine", "engine tok/s", "{:.2f}"),
            Column("app", "app tok/s", "{:.2f}"),
        ]
        rows = [
            {"trial": index + 1, "engine": engine, "app": app}
            for index, (engine, app) in enumerate(
                zip(result.engine_tokens_per_second, result.app_tokens_per_second, strict=True)
            )
        ]
        title = f"Display overhead: {escape(loaded.source.name)}, {max_new_tokens} tokens per reply, alternating"
        checks = [Check("app / engine decode speed (medians)", result.ratio, APP_VS_ENGINE_MIN, at_most=False)]
        print_report(_stdout(), title, columns, rows, checks)
        write_csv(out / "display.csv", [column.key for column in columns], rows)


# ---- shared steps ---------------------------------------------------------------------------


def _stdout() -> Console:
    # Made per use, not at import, so the width follows the terminal (or COLUMNS) of this run.
    return Console(highlight=False)


def _load(model: str | None, device: str, dtype: str) -> LoadedModel:
    from streamchat.loading import LoadOptions, load_model

    return load_model(LoadOptions(model=model, device=device, dtype=dtype), notify=stderr.print)


def _bench_model(model: str | None, random_init: str | None, device: str, dtype: str) -> BenchModel:
    from streamchat.bench.models import BenchModel, random_model

    if random_init is None:
        loaded = _load(model, device, dtype)
        return BenchModel(loaded.model, loaded.source.name, loaded.device, loaded.dtype)
    if model is not None:
        raise ConfigError("--model and --random-init exclude each other: give one")
    return random_model(random_init, device, dtype)


def _score(model: Any, ids: torch.Tensor, policies: tuple[str, ...], sizes: PplSizes) -> list[PolicyRun]:
    """Run each policy with a progress bar on stderr; report each as it finishes."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from streamchat.bench.ppl import run_policy

    runs = []
    columns = (TextColumn("{task.description:>9}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=stderr, transient=True) as progress:
        for policy in policies:
            task = progress.add_task(policy, total=ids.shape[-1] - 1)
            run = run_policy(model, ids, policy, sizes, lambda count, task=task: progress.advance(task, count))
            progress.remove_task(task)
            progress.console.print(f"{policy:>9}: PPL {run.ppl():.2f} in {run.seconds:.1f} s")
            runs.append(run)
    return runs


def _save(out: Path, tables: dict[str, tuple[list[str], list[dict[str, Any]]]], plot_name: str, draw: Any) -> None:
    written = [write_csv(out / name, columns, rows) for name, (columns, rows) in tables.items()]
    plot = save_plot(out / plot_name, draw)
    if plot is None:
        stderr.print(MATPLOTLIB_MISSING, markup=False)
    else:
        written.append(plot)
    _stdout().print("wrote " + ", ".join(str(path) for path in written), markup=False)


@contextmanager
def _memory_errors() -> Iterator[None]:
    import torch

    try:
        yield
    except torch.cuda.OutOfMemoryError:
        raise OutOfMemoryError(
            "the benchmark ran out of GPU memory: lower --tokens or --checkpoints, or use a smaller model"
        ) from None
