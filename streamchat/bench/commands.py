"""`streamchat bench ppl|speed|keep|recall|display|decode|serve`: the Typer sub-app (mounted as `bench`).

The model options are `run`'s (streamchat.interface.options) and, as for `run`, also come
from the environment and the config file. Each command prints a table and the target
checks, and writes CSV files (and, for ppl and speed, a PNG plot) into --out. torch,
transformers and matplotlib load only once a command runs.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from streamchat import defaults
from streamchat.errors import ConfigError
from streamchat.interface.config import RunConfig, load_options, load_run_config
from streamchat.interface.options import (
    Command,
    DeviceOption,
    DtypeOption,
    Group,
    KeepOption,
    ModelOption,
    QuantizeOption,
    TpOption,
)
from streamchat.interface.reporting import notify, reported_errors, stderr
from streamchat.measure.report import print_report, save_results
from streamchat.measure.sizes import sizes_for
from streamchat.placement.quantization import precision_label

if TYPE_CHECKING:
    from streamchat.loading import LoadedModel
    from streamchat.measure.models import BenchModel

bench_app = typer.Typer(
    name="bench",
    cls=Group,
    help="Benchmarks: perplexity (ppl), decode speed and memory (speed), the kept system prompt (keep), recalled "
    "facts (recall), the live display (display), decode against other engines (decode), the HTTP API (serve).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

OutOption = Annotated[Path, typer.Option("--out", help="Directory for the CSV files and the plot.", metavar="DIR")]
QuickOption = Annotated[
    bool, typer.Option("--quick", help="Toy sizes that finish in seconds; options given still apply. A smoke test.")
]


def _size(help_text: str, default: object, *names: str, metavar: str = "N") -> Any:
    """An option that falls back to the full size (or the --quick one) when not given."""
    return typer.Option(*names, help=f"{help_text} \\[default: {default}]", show_default=False, metavar=metavar)


def _keep(default: int) -> Any:
    """The first tokens the streaming cache keeps forever, spelled as `run --keep N`; --sinks is its earlier name."""
    return _size("First tokens kept forever (attention sinks), as `run --keep N`.", default, "--keep", "--sinks")


WINDOW_HELP = "Recent tokens kept in the rolling window."


@bench_app.command(cls=Command)
def ppl(
    text: Annotated[
        Path, typer.Option(help="A long UTF-8 text, e.g. a Gutenberg novel.", show_default=False, metavar="FILE")
    ],
    start_at: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Start scoring where this text first appears (skip a book's front matter).",
            show_default=False,
            metavar="TEXT",
        ),
    ] = None,
    tokens: Annotated[int | None, _size("Tokens of the text to score.", defaults.PPL_TOKENS)] = None,
    keep: Annotated[int | None, _keep(defaults.PPL_SINKS)] = None,
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.PPL_WINDOW)] = None,
    chunk: Annotated[
        int | None, _size("Tokens per forward pass for window, recompute and streaming.", defaults.PPL_CHUNK)
    ] = None,
    policies: Annotated[
        str | None, _size(f"Comma-separated, from {','.join(defaults.BENCH_POLICIES)}.", "all", metavar="LIST")
    ] = None,
    longer_keep: Annotated[
        int | None,
        _size(
            "The keep policy's kept prefix (first tokens, a system turn's worth), in a cache as large as "
            "--keep + --window. It was --keep here before; --keep now means streaming's kept tokens, as for `run`.",
            defaults.PPL_KEEP,
        ),
    ] = None,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """Perplexity of a long text under dense, window, recompute, streaming and keep caches (the paper's Figure 3).

    The keep policy: what a longer kept prefix (--keep system) costs at the same capacity.

    Defaults: the paper's cache, --keep 4 + --window 1020, over 20,000 tokens; the keep policy's 60 + 964.

    --keep is the number of first tokens streaming keeps, as for `run` (--sinks, its earlier name, still works).
    The keep policy's prefix, which --keep set here before, is --longer-keep.
    """
    from streamchat.bench import ppl as bench
    from streamchat.measure.memory import out_of_memory_errors

    with reported_errors():
        given = {"tokens": tokens, "sinks": keep, "window": window, "chunk": chunk, "longer_keep": longer_keep}
        sizes = sizes_for(quick, bench.FULL, bench.QUICK, **given)
        chosen = bench.parse_policies(policies)
        if "keep" in chosen:
            bench.require_keep_fits(sizes)
        content = bench.read_text(text, start_at)
        loaded = _load(_configured(model, device, dtype, quantize))
        ids = bench.first_tokens(content, loaded.tokenizer, sizes.tokens, loaded.device)
        with out_of_memory_errors("--tokens or --window"):
            runs = bench.run_policies(loaded.model, ids, chosen, sizes, stderr)
        columns, rows = bench.summary_columns(sizes), bench.summary_rows(runs, sizes)
        title = (
            f"Perplexity: {escape(loaded.source.name)} ({_precision(loaded)}) on {escape(text.name)}, "
            f"{sizes.tokens:,} tokens, "
            f"cache {sizes.sinks}+{sizes.window}, chunk {sizes.chunk} (dense {bench.DENSE_CHUNK})"
        )
        print_report(_stdout(), title, columns, rows, bench.checks(rows))
        save_results(
            out,
            {
                "ppl.csv": ([column.key for column in columns], rows),
                "ppl-curve.csv": (bench.curve_columns(runs), bench.curve_rows(runs, sizes.bucket)),
            },
            {"ppl.png": bench.draw_curves(runs, sizes, bench.training_context_of(loaded.model))},
            console=_stdout(),
            notes=stderr,
        )


RandomInitOption = Annotated[
    str | None,
    typer.Option(
        "--random-init",
        metavar="CONFIG",
        help="Random weights in a known shape instead of --model: a preset (llama-2-7b, llama-2-13b, smollm2-1.7b, "
        "llama-3.2-1b, smollm2-135m, tiny), a config.json, or a transformers model type. No download.",
        show_default=False,
    ),
]


@bench_app.command(cls=Command)
def speed(
    model: ModelOption = None,
    random_init: RandomInitOption = None,
    keep: Annotated[int | None, _keep(defaults.SINKS)] = None,
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.WINDOW)] = None,
    checkpoints: Annotated[
        str | None,
        _size(
            "Tokens streamed before each measurement, comma-separated.",
            ",".join(map(str, defaults.SPEED_CHECKPOINTS)),
            metavar="LIST",
        ),
    ] = None,
    steps: Annotated[
        int | None, _size("Decode steps timed per policy at each checkpoint.", defaults.SPEED_STEPS)
    ] = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
    tp: TpOption = None,
) -> None:
    """Per-token decode latency and peak memory of streaming, dense and recompute, as a session grows.

    Defaults: the chat's cache (4 + 2000), 64,000 tokens streamed, all three policies at the same fill.
    With --tp N: decode ms/token of one reply, the model sharded over N processes, against one process.
    """
    from streamchat.bench import speed as bench
    from streamchat.measure.memory import out_of_memory_errors

    if tp is not None:
        from streamchat.bench.tensor_parallel import tp_speed
        from streamchat.loading import load_model

        with reported_errors():
            config = _configured(model, device, dtype, quantize, random_init)
            options = load_options(config)
            steps = steps or defaults.TP_BENCH_STEPS
            code = tp_speed(tp, options, window or defaults.WINDOW, steps, load_model, stderr.print, random_init)
        raise typer.Exit(code)

    with reported_errors():
        given = {"sinks": keep, "window": window, "checkpoints": bench.parse_checkpoints(checkpoints), "steps": steps}
        sizes = sizes_for(quick, bench.FULL, bench.QUICK, **given)
        # Building random weights can run out of memory too (--random-init llama-2-13b on a small machine).
        with out_of_memory_errors("--window"):
            chosen = _bench_model(_configured(model, device, dtype, quantize, random_init), random_init)
            measurements, memory_kind = bench.run_speed(
                chosen.model, sizes, on_measurement=lambda measured: stderr.print(bench.describe(measured))
            )
        title = (
            f"Decode speed: {escape(chosen.name)} on {chosen.device.type} ({_precision(chosen)}), "
            f"cache {sizes.sinks}+{sizes.window}, median of {sizes.steps} steps"
        )
        columns, rows = bench.columns(), bench.rows(measurements)
        print_report(_stdout(), title, columns, rows, bench.checks(measurements, sizes), bench.caption(memory_kind))
        save_results(
            out,
            {"speed.csv": ([column.key for column in columns], rows)},
            {"speed.png": bench.draw_speed(measurements, sizes, memory_kind)},
            console=_stdout(),
            notes=stderr,
        )


@bench_app.command(cls=Command)
def keep(
    transcript: Annotated[
        Path,
        typer.Option(
            help="User turns to stream: MT-bench's questions, JSONL chat lines or plain lines (as `run` reads them).",
            show_default=False,
            metavar="FILE",
        ),
    ],
    turns: Annotated[int | None, _size("User turns streamed before the last probe.", defaults.KEEP_BENCH_TURNS)] = None,
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.KEEP_BENCH_WINDOW)] = None,
    reply_tokens: Annotated[int | None, _size("Longest generated reply.", 96)] = None,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """After a long chat, does the model still know its system prompt's secret? --keep system against --keep 4.

    Defaults: 40 turns through a 256-token window; the answer's log-probability after turn 1 and turn 40.
    """
    from streamchat.bench import keep as bench
    from streamchat.interface.transcript import UserTurn, read_transcript_file
    from streamchat.measure.memory import out_of_memory_errors

    with reported_errors():
        sizes = sizes_for(quick, bench.FULL, bench.QUICK, turns=turns, window=window, reply_tokens=reply_tokens)
        items = read_transcript_file(str(transcript), transcript_format="auto", turns="line")
        texts = bench.user_turns((item.text for item in items if isinstance(item, UserTurn)), sizes.turns)
        loaded = _load(_configured(model, device, dtype, quantize))
        with out_of_memory_errors("--window"):
            conversation = bench.generate_conversation(
                loaded.model,
                loaded.tokenizer,
                texts,
                sizes,
                on_turn=lambda number: stderr.print(f"generated reply {number}/{sizes.turns}", highlight=False),
            )
            runs = []
            for policy in bench.POLICIES:
                runs.append(bench.read_with(loaded.model, loaded.tokenizer, conversation, policy, sizes.window))
                stderr.print(f"--keep {policy}: read in {runs[-1].seconds:.1f} s", highlight=False)
        title = (
            f"Secret word: {escape(loaded.source.name)}, {sizes.turns} turns of {escape(transcript.name)} "
            f"through a {sizes.window}-token window, mean log-probability per answer token"
        )
        columns, rows = bench.columns(sizes), bench.rows(runs)
        print_report(_stdout(), title, columns, rows, bench.checks(runs))
        save_results(
            out,
            {
                "keep.csv": ([column.key for column in columns], rows),
                "keep-curve.csv": (bench.curve_columns(), bench.curve_rows(runs)),
            },
            {"keep.png": bench.draw_curves(runs)},
            console=_stdout(),
            notes=stderr,
        )


@bench_app.command(cls=Command)
def recall(
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.RECALL_BENCH_WINDOW)] = None,
    reply_tokens: Annotated[
        int | None, _size("Longest generated filler reply.", defaults.RECALL_BENCH_REPLY_TOKENS)
    ] = None,
    facts: Annotated[int | None, _size("Facts stated (of those shipped).", defaults.RECALL_BENCH_FACTS)] = None,
    filler: Annotated[
        Path | None,
        typer.Option(
            help="MT-bench's question.jsonl for the filler turns, when there is one; else the questions shipped.",
            show_default=False,
            metavar="FILE",
        ),
    ] = None,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """Facts stated early, evicted by filler turns, asked for again: recall off, recall on, and in the window.

    Defaults: 10 facts, a 256-token window, filler until every fact has left it; time to first token at turn 100.
    """
    from streamchat.bench import recall as bench
    from streamchat.measure.memory import out_of_memory_errors

    with reported_errors():
        sizes = sizes_for(quick, bench.FULL, bench.QUICK, window=window, reply_tokens=reply_tokens, facts=facts)
        shipped, distractors = bench.shipped_facts()
        chosen, distractors = shipped[: sizes.facts], distractors[: sizes.distractors]
        questions = bench.filler_questions(filler)
        loaded = _load(_configured(model, device, dtype, quantize))
        with out_of_memory_errors("--window"):
            run = bench.RecallBench(
                loaded.model, loaded.tokenizer, sizes, on_step=lambda step: stderr.print(step, highlight=False)
            )
            results, others = run.run(chosen, distractors, questions)
            replies = [message["content"] for message in run.session.transcript[1::2]][len(chosen) :]
            turn, ttft_off, ttft_on = run.time_to_first_token(chosen, questions, replies or ["Noted."])
        costs = bench.Costs(
            turn, ttft_off, ttft_on, bench.search_costs(chosen, questions, replies or ["Noted."], sizes)
        )
        title = (
            f"Recall: {escape(loaded.source.name)}, {len(chosen)} facts through a {sizes.window}-token window, "
            "mean log-probability per answer token"
        )
        columns, rows = bench.columns(), bench.rows(results, others)
        print_report(_stdout(), title, columns, rows, [])
        print_report(
            _stdout(),
            "Recall: cost",
            bench.cost_columns(),
            bench.cost_rows(costs),
            bench.checks(results, others, costs),
        )
        save_results(
            out,
            {
                "recall.csv": ([column.key for column in columns], rows),
                "recall-cost.csv": ([column.key for column in bench.cost_columns()], bench.cost_rows(costs)),
            },
            {"recall.png": bench.draw(results, costs)},
            console=_stdout(),
            notes=stderr,
        )


@bench_app.command(cls=Command)
def display(
    model: ModelOption = None,
    trials: Annotated[
        int, typer.Option(help="Replies per side (the median counts).", metavar="N")
    ] = defaults.DISPLAY_TRIALS,
    max_new_tokens: Annotated[
        int, typer.Option(help="Tokens per reply.", metavar="N")
    ] = defaults.DISPLAY_MAX_NEW_TOKENS,
    window: Annotated[
        int | None, _size(f"{WINDOW_HELP} As for `run`, also from the environment and config file.", defaults.WINDOW)
    ] = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
) -> None:
    """Decode speed of the chat app (live Rich display) against the engine alone, side by side."""
    from streamchat.bench import display_overhead as bench
    from streamchat.measure.memory import out_of_memory_errors

    with reported_errors():
        config = _configured(model, device, dtype, quantize, window=window)
        sizes = bench.DisplaySizes(trials=trials, max_new_tokens=max_new_tokens, window=config.window)
        loaded = _load(config)
        with out_of_memory_errors("--window or --max-new-tokens"):
            result = bench.measure_display_overhead(loaded.model, loaded.tokenizer, sizes)
        columns, rows = bench.columns(), bench.rows(result)
        title = (
            f"Display overhead: {escape(loaded.source.name)}, cache {sizes.sinks}+{sizes.window}, "
            f"{max_new_tokens} tokens per reply, alternating"
        )
        print_report(_stdout(), title, columns, rows, bench.checks(result))
        save_results(
            out, {"display.csv": ([column.key for column in columns], rows)}, {}, console=_stdout(), notes=stderr
        )


@bench_app.command(cls=Command)
def decode(
    model: ModelOption = None,
    random_init: RandomInitOption = None,
    max_new_tokens: Annotated[int | None, _size("Tokens per reply.", 64)] = None,
    trials: Annotated[int | None, _size("Replies per row (the median counts).", 5)] = None,
    window: Annotated[int | None, _size(WINDOW_HELP, defaults.WINDOW)] = None,
    full_cache: Annotated[
        bool, typer.Option("--full-cache", help="Fill the cache before the reply: every step reads the whole window.")
    ] = False,
    compiled: Annotated[
        bool,
        typer.Option("--compiled/--no-compiled", help="Also time the compiled decode step (compiles first, untimed)."),
    ] = True,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """Decode speed of streamchat, eager and compiled, against transformers' generate(), llama.cpp and the limit.

    Rows: streamchat as `run` loads the model (or with the --dtype and --quantize given), eager
    and compiled, and on CPU in float32 unquantized; generate() with a StaticCache on each;
    llama.cpp on the same GGUF when llama-cpp-python is installed. Greedy, same prompt,
    trials alternating between rows.
    """
    from streamchat.bench import decode as bench
    from streamchat.loading.conversion import use_compile_cache
    from streamchat.measure.memory import out_of_memory_errors

    with reported_errors():
        given = {"max_new_tokens": max_new_tokens, "trials": trials, "window": window}
        sizes = dataclasses.replace(sizes_for(quick, bench.FULL, bench.QUICK, **given), full_cache=full_cache)
        config = _configured(model, device, dtype, quantize, random_init)
        setting = bench.run_defaults(config.dtype, config.quantize)
        device_type = _device_type(config.device)
        use_compile_cache()

        def subject_for(chosen: bench.Setting) -> bench.Subject:
            loaded = _bench_model(
                dataclasses.replace(config, dtype=chosen.dtype, quantize=chosen.quantize), random_init
            )
            tokenizer = getattr(loaded, "tokenizer", None)
            if full_cache or tokenizer is None:
                ids = bench.filling_ids(loaded.model, sizes)
            else:
                ids = bench.prompt_ids(tokenizer, loaded.device)
            return bench.Subject(loaded.model, ids, _precision(loaded))

        gguf = None
        if random_init is None and device_type == "cpu":
            gguf, reason = bench.llama_cpp_gguf(config.model)
            if gguf is None:
                stderr.print(reason, markup=False)
        with out_of_memory_errors("--window or --max-new-tokens"):
            rows = bench.measure(setting, sizes, subject_for, device_type, compiled, gguf)
        name = f"random {random_init}" if random_init else config.model
        title = (
            f"Decode speed: {escape(name)} on {device_type}, greedy, {sizes.max_new_tokens} tokens per reply, "
            f"cache {sizes.sinks}+{sizes.window}{' full' if full_cache else ''}, median of {sizes.trials}"
        )
        columns = bench.columns()
        caption = "limit: (weight bytes + KV-cache bytes read per token) / bandwidth of one large GEMV, measured now"
        checks = bench.checks(rows, setting.label, device_type)
        print_report(_stdout(), title, columns, rows, checks, caption)
        save_results(
            out, {"decode.csv": ([column.key for column in columns], rows)}, {}, console=_stdout(), notes=stderr
        )


@bench_app.command(cls=Command)
def serve(
    conversations: Annotated[
        str | None, _size("Conversations side by side, comma-separated: a row per value.", "1,2,4", metavar="LIST")
    ] = None,
    turns: Annotated[int | None, _size("User turns per conversation.", 40)] = None,
    max_new_tokens: Annotated[int | None, _size("Most tokens per reply (max_tokens).", 64)] = None,
    window: Annotated[
        int | None,
        _size(
            "Recent tokens streamchat's cache keeps, as `serve --window`; also from the environment and config file.",
            f"{defaults.WINDOW}",
        ),
    ] = None,
    n_ctx: Annotated[int | None, _size("llama.cpp's context per conversation, in tokens.", 2048)] = None,
    llama_server: Annotated[
        Path | None,
        typer.Option(
            "--llama-server",
            help="A llama.cpp `llama-server` binary to run instead of llama-cpp-python's server.",
            show_default=False,
            metavar="PATH",
        ),
    ] = None,
    context_shift: Annotated[
        bool, typer.Option("--context-shift", help="Start llama-server with --context-shift (past n_ctx: shift).")
    ] = False,
    time_limit: Annotated[
        int | None, _size("Seconds each row may run; turns not sent by then are errors.", 3600)
    ] = None,
    model: ModelOption = None,
    keep: KeepOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: OutOption = Path(defaults.BENCH_OUT_DIR),
    quick: QuickOption = False,
) -> None:
    """The HTTP API as clients use it: C conversations of T turns, the whole history resent every turn.

    Starts `streamchat serve` (with the model options given), then llama.cpp's server on the
    same GGUF when installed (llama-cpp-python[server], or --llama-server PATH), each afresh
    for every row, on 127.0.0.1. Per row: generated tokens/s over all conversations, time to
    first token early (turns 2-11) and late (the last 10), prompt tokens sent and read per
    turn, errors and empty replies.
    """
    from streamchat.bench import serve as bench

    with reported_errors():
        given = {
            "conversations": bench.parse_conversations(conversations),
            "turns": turns,
            "max_new_tokens": max_new_tokens,
            "window": window,
            "n_ctx": n_ctx,
            "time_limit": time_limit,
        }
        sizes = sizes_for(quick, bench.FULL, bench.QUICK, **given)
        config = _configured(model, device, dtype, quantize, keep=keep, window=sizes.window)
        model_options = bench.serve_options(
            model=model, keep=keep, window=sizes.window, device=device, dtype=dtype, quantize=quantize
        )
        gguf, reason = bench.llama_cpp_gguf(config.model, llama_server)
        if gguf is None:
            stderr.print(reason, markup=False)
        servers = bench.Servers(model_options, str(config.keep), gguf, llama_server, context_shift)
        rows, requests = bench.measure(servers, sizes, lambda text: stderr.print(text, markup=False, highlight=False))
        title = (
            f"Serving: {escape(config.model)}, {sizes.turns} turns, at most {sizes.max_new_tokens} tokens a reply, "
            f"greedy, the whole history resent; streamchat window {config.window}, llama.cpp n_ctx {sizes.n_ctx}"
        )
        caption = (
            f"early: turns {bench.EARLY_TURNS.start}-{bench.EARLY_TURNS.stop - 1}; late: the last "
            f"{bench.LATE_TURNS}; read = prompt_tokens - cached_tokens, as the server reports them"
        )
        columns = bench.columns()
        print_report(_stdout(), title, columns, rows, [], caption)
        save_results(
            out,
            {
                "serve.csv": ([column.key for column in columns], rows),
                "serve-requests.csv": (bench.REQUEST_COLUMNS, requests),
            },
            {"serve-ttft.png": bench.draw_ttft(requests)},
            console=_stdout(),
            notes=stderr,
        )


def _device_type(device: str) -> str:
    """ "cpu" or "cuda": where the rows ran (device "auto" settles at load time)."""
    from streamchat.placement.device import choose_device, detect_accelerators

    return choose_device(device, detect_accelerators()).split(":")[0]


# ---- shared steps ---------------------------------------------------------------------------


def _stdout() -> Console:
    # Made per use, not at import, so the width follows the terminal (or COLUMNS) of this run.
    return Console(highlight=False, emoji=False)


def _configured(
    model: str | None,
    device: str | None,
    dtype: str | None,
    quantize: str | None,
    random_init: str | None = None,
    **more: object,
) -> RunConfig:
    """The model options as `run` takes them: the command line's, else the environment's, the file's, the defaults."""
    if model is not None and random_init is not None:
        raise ConfigError("--model and --random-init exclude each other: give one")
    return load_run_config({"model": model, "device": device, "dtype": dtype, "quantize": quantize, **more})


def _load(config: RunConfig) -> LoadedModel:
    from streamchat.loading import load_model

    return load_model(load_options(config), notify=notify)


def _precision(loaded: LoadedModel | BenchModel) -> str:
    return precision_label(loaded.dtype, loaded.quantization)


def _bench_model(config: RunConfig, random_init: str | None) -> BenchModel:
    from streamchat.measure.models import BenchModel, random_model

    if random_init is not None:
        return random_model(random_init, config.device, config.dtype, config.quantize)
    loaded = _load(config)
    return BenchModel(
        loaded.model, loaded.source.name, loaded.device, loaded.dtype, loaded.quantization, loaded.tokenizer
    )
