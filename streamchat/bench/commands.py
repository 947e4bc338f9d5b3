"""`streamchat bench ppl|speed|keep|recall|display|decode|load|serve`: the Typer sub-app (mounted as `bench`).

Each command declares its options and its steps, sizes -> measure -> report, which bench/runner.py runs and
saves. The model options are `run`'s (streamchat.interface.options) and, as for `run`, also come from the
environment and the config file. Each command prints a table and the target checks, and writes CSV files (and,
for most, a PNG plot) into --out. torch, transformers and matplotlib load only once a command runs.
"""

from __future__ import annotations

import functools

import typer
from rich.markup import escape

from streamchat import defaults
from streamchat.bench import options
from streamchat.bench.options import sizes_for
from streamchat.bench.runner import Report, ReportTable, run_bench
from streamchat.interface.options import (
    Command,
    DeviceOption,
    DtypeOption,
    Group,
    KeepOption,
    KvCacheOption,
    ModelOption,
    QuantizeOption,
    TpOption,
)
from streamchat.interface.reporting import reported_errors, stderr
from streamchat.measure.models import ModelChoice, device_type

bench_app = typer.Typer(
    name="bench",
    cls=Group,
    help="Benchmarks: perplexity (ppl), decode speed and memory (speed), the kept system prompt (keep), recalled "
    "facts (recall), the live display (display), decode against other engines (decode), starting a model (load), "
    "the HTTP API (serve).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@bench_app.command(cls=Command)
def ppl(
    text: options.TextOption,
    start_at: options.FromOption = None,
    tokens: options.PplTokensOption = None,
    keep: options.PplKeepOption = None,
    window: options.PplWindowOption = None,
    chunk: options.ChunkOption = None,
    policies: options.PoliciesOption = None,
    longer_keep: options.LongerKeepOption = None,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
) -> None:
    """Perplexity of a long text under dense, window, recompute, streaming and keep caches (the paper's Figure 3).

    The keep policy: what a longer kept prefix (--keep system) costs at the same capacity.

    Defaults: the paper's cache, --keep 4 + --window 1020, over 20,000 tokens; the keep policy's 60 + 964.

    --keep is the number of first tokens streaming keeps, as for `run` (--sinks, its earlier name, still works).
    The keep policy's prefix, which --keep set here before, is --longer-keep.
    """
    from streamchat.bench import ppl as bench

    def measure(sizes: bench.PplSizes) -> Report:
        chosen_policies = bench.parse_policies(policies)
        if "keep" in chosen_policies:
            bench.require_keep_fits(sizes)
        content = bench.read_text(text, start_at)
        loaded = ModelChoice(model, device, dtype, quantize, kv_cache=kv_cache).bench_model()
        ids = bench.first_tokens(content, loaded.tokenizer, sizes.tokens, loaded.device)
        runs = bench.run_policies(loaded.model, ids, chosen_policies, sizes, stderr)
        rows = bench.summary_rows(runs, sizes)
        title = (
            f"Perplexity: {escape(loaded.name)} ({loaded.precision}) on {escape(text.name)}, {sizes.tokens:,} tokens, "
            f"cache {sizes.sinks}+{sizes.window}, chunk {sizes.chunk} (dense {bench.DENSE_CHUNK})"
        )
        return Report(
            [ReportTable("ppl.csv", title, bench.summary_columns(sizes), rows, bench.checks(rows))],
            {"ppl-curve.csv": (bench.curve_columns(runs), bench.curve_rows(runs, sizes.bucket))},
            {"ppl.png": bench.draw_curves(runs, sizes, bench.training_context_of(loaded.model))},
        )

    given = {"tokens": tokens, "sinks": keep, "window": window, "chunk": chunk, "longer_keep": longer_keep}
    run_bench(out, lambda: sizes_for(quick, bench.FULL, bench.QUICK, **given), measure, "--tokens or --window")


@bench_app.command(cls=Command)
def speed(
    model: ModelOption = None,
    random_init: options.RandomInitOption = None,
    keep: options.ChatKeepOption = None,
    window: options.ChatWindowOption = None,
    checkpoints: options.CheckpointsOption = None,
    steps: options.StepsOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
    tp: TpOption = None,
) -> None:
    """Per-token decode latency and peak memory of streaming, dense and recompute, as a session grows.

    Defaults: the chat's cache (4 + 2000), 64,000 tokens streamed, all three policies at the same fill.
    With --tp N: decode ms/token of one reply, the model sharded over N processes, against one process.
    """
    from streamchat.bench import speed as bench

    choice = ModelChoice(model, device, dtype, quantize, random_init, kv_cache)
    if tp is not None:
        with reported_errors():
            raise typer.Exit(bench.tp_speed(tp, choice, window, steps, stderr.print))

    def sizes() -> bench.SpeedSizes:
        given = {"sinks": keep, "window": window, "checkpoints": bench.parse_checkpoints(checkpoints), "steps": steps}
        return sizes_for(quick, bench.FULL, bench.QUICK, **given)

    def measure(sizes: bench.SpeedSizes) -> Report:
        subject = choice.bench_model()
        measurements, memory_kind = bench.run_speed(
            subject.model, sizes, on_measurement=lambda measured: stderr.print(bench.describe(measured))
        )
        title = (
            f"Decode speed: {escape(subject.name)} on {subject.device.type} ({subject.precision}), "
            f"cache {sizes.sinks}+{sizes.window}, median of {sizes.steps} steps"
        )
        checks, caption = bench.checks(measurements, sizes), bench.caption(memory_kind)
        return Report(
            [ReportTable("speed.csv", title, bench.columns(), bench.rows(measurements), checks, caption)],
            plots={"speed.png": bench.draw_speed(measurements, sizes, memory_kind)},
        )

    run_bench(out, sizes, measure, "--window")


@bench_app.command(cls=Command)
def keep(
    transcript: options.TranscriptOption,
    turns: options.KeepTurnsOption = None,
    window: options.KeepWindowOption = None,
    reply_tokens: options.KeepReplyTokensOption = None,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
) -> None:
    """After a long chat, does the model still know its system prompt's secret? --keep system against --keep 4.

    Defaults: 40 turns through a 256-token window; the answer's log-probability after turn 1 and turn 40.
    """
    from streamchat.bench import keep as bench
    from streamchat.interface.transcript import UserTurn, read_transcript_file

    def measure(sizes: bench.KeepSizes) -> Report:
        items = read_transcript_file(str(transcript), transcript_format="auto", turns="line")
        texts = bench.user_turns((item.text for item in items if isinstance(item, UserTurn)), sizes.turns)
        loaded = ModelChoice(model, device, dtype, quantize, kv_cache=kv_cache).bench_model()
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
            f"Secret word: {escape(loaded.name)}, {sizes.turns} turns of {escape(transcript.name)} "
            f"through a {sizes.window}-token window, mean log-probability per answer token"
        )
        return Report(
            [ReportTable("keep.csv", title, bench.columns(sizes), bench.rows(runs), bench.checks(runs))],
            {"keep-curve.csv": (bench.curve_columns(), bench.curve_rows(runs))},
            {"keep.png": bench.draw_curves(runs)},
        )

    given = {"turns": turns, "window": window, "reply_tokens": reply_tokens}
    run_bench(out, lambda: sizes_for(quick, bench.FULL, bench.QUICK, **given), measure, "--window")


@bench_app.command(cls=Command)
def recall(
    window: options.RecallWindowOption = None,
    reply_tokens: options.RecallReplyTokensOption = None,
    facts: options.FactsOption = None,
    filler: options.FillerOption = None,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
) -> None:
    """Facts stated early, evicted by filler turns, asked for again: recall off, recall on, and in the window.

    Defaults: 10 facts, a 256-token window, filler until every fact has left it; time to first token at turn 100.
    """
    from streamchat.bench import recall as bench
    from streamchat.measure.recall_facts import filler_questions, search_costs, shipped_facts

    def measure(sizes: bench.RecallSizes) -> Report:
        shipped, distractors = shipped_facts()
        chosen, distractors = shipped[: sizes.facts], distractors[: sizes.distractors]
        questions = filler_questions(filler)
        loaded = ModelChoice(model, device, dtype, quantize, kv_cache=kv_cache).bench_model()
        run = bench.RecallBench(
            loaded.model, loaded.tokenizer, sizes, on_step=lambda step: stderr.print(step, highlight=False)
        )
        results, others = run.run(chosen, distractors, questions)
        replies = [message["content"] for message in run.session.transcript[1::2]][len(chosen) :] or ["Noted."]
        turn, ttft_off, ttft_on = run.time_to_first_token(chosen, questions, replies)
        search = search_costs(chosen, questions, replies, sizes.search_turns, sizes.repeats)
        costs = bench.Costs(turn, ttft_off, ttft_on, search)
        title = (
            f"Recall: {escape(loaded.name)}, {len(chosen)} facts through a {sizes.window}-token window, "
            "mean log-probability per answer token"
        )
        checks = bench.checks(results, others, costs)
        return Report(
            [
                ReportTable("recall.csv", title, bench.columns(), bench.rows(results, others)),
                ReportTable("recall-cost.csv", "Recall: cost", bench.cost_columns(), bench.cost_rows(costs), checks),
            ],
            plots={"recall.png": bench.draw(results, costs)},
        )

    given = {"window": window, "reply_tokens": reply_tokens, "facts": facts}
    run_bench(out, lambda: sizes_for(quick, bench.FULL, bench.QUICK, **given), measure, "--window")


@bench_app.command(cls=Command)
def display(
    model: ModelOption = None,
    trials: options.DisplayTrialsOption = defaults.DISPLAY_TRIALS,
    max_new_tokens: options.DisplayTokensOption = defaults.DISPLAY_MAX_NEW_TOKENS,
    window: options.DisplayWindowOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
) -> None:
    """Decode speed of the chat app (live Rich display) against the engine alone, side by side."""
    from streamchat.bench import display_overhead as bench

    choice = ModelChoice(model, device, dtype, quantize, kv_cache=kv_cache)

    def sizes() -> bench.DisplaySizes:
        # No --quick sizes to fall back on; the window as `run` reads it (also the environment, the config file).
        return bench.DisplaySizes(trials, max_new_tokens, window=choice.config(window=window).window)

    def measure(sizes: bench.DisplaySizes) -> Report:
        loaded = choice.bench_model()
        result = bench.measure_display_overhead(loaded.model, loaded.tokenizer, sizes)
        title = (
            f"Display overhead: {escape(loaded.name)}, cache {sizes.sinks}+{sizes.window}, "
            f"{max_new_tokens} tokens per reply, alternating"
        )
        return Report([ReportTable("display.csv", title, bench.columns(), bench.rows(result), bench.checks(result))])

    run_bench(out, sizes, measure, "--window or --max-new-tokens")


@bench_app.command(cls=Command)
def decode(
    model: ModelOption = None,
    random_init: options.RandomInitOption = None,
    max_new_tokens: options.DecodeTokensOption = None,
    trials: options.DecodeTrialsOption = None,
    window: options.ChatWindowOption = None,
    full_cache: options.FullCacheOption = False,
    compiled: options.CompiledOption = True,
    baseline: options.BaselineOption = True,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
) -> None:
    """Decode speed of streamchat, eager and compiled, against transformers' generate(), llama.cpp and the limit.

    Rows: streamchat as `run` loads the model (or with the --dtype and --quantize given), eager and compiled, and on
    CPU in float32 unquantized (unless --no-baseline, or where its weights would not fit in the memory available: the
    table says which); generate() with a StaticCache on each; llama.cpp on the same GGUF when llama-cpp-python is
    installed. Greedy, same prompt, trials alternating between rows.
    """
    from streamchat.bench import decode as bench
    from streamchat.loading.conversion import use_compile_cache

    choice = ModelChoice(model, device, dtype, quantize, random_init, kv_cache)

    def measure(sizes: bench.DecodeSizes) -> Report:
        config = choice.config()
        setting = bench.run_defaults(config.dtype, config.quantize)
        where = device_type(config.device)
        use_compile_cache()
        gguf = bench.llama_cpp_file(config.model, random_init, where, lambda text: stderr.print(text, markup=False))
        subject_for = functools.partial(bench.subject, choice, config, sizes=sizes)
        rows, left_out = bench.measure(setting, sizes, subject_for, where, compiled, gguf, baseline)
        title = bench.title(f"random {random_init}" if random_init else config.model, where, sizes)
        checks = bench.checks(rows, setting.label, where)
        return Report([ReportTable("decode.csv", title, bench.columns(), rows, checks, bench.caption(left_out))])

    given = {"max_new_tokens": max_new_tokens, "trials": trials, "window": window, "full_cache": full_cache}
    run_bench(out, lambda: sizes_for(quick, bench.FULL, bench.QUICK, **given), measure, "--window or --max-new-tokens")


@bench_app.command(cls=Command)
def load(
    model: ModelOption = None,
    trials: options.LoadTrialsOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
) -> None:
    """Start-up: seconds until the model is loaded, peak RSS, disk added to streamchat's cache; first and later.

    Each start is a fresh `streamchat info` process, which loads the model as `run` does. The first has an empty
    cache of its own (STREAMCHAT_CACHE_DIR: a new temporary directory), where a GGUF file converts; later starts
    (--trials) reuse it. Beside them: llama.cpp loading the same GGUF, when llama-cpp-python is installed.
    """
    from streamchat.bench import load as bench

    def measure(sizes: bench.LoadSizes) -> Report:
        choice = ModelChoice(model, device, dtype, quantize)
        config = choice.config()  # every option checked before a child starts
        rows, skipped = bench.measure(choice, config.model, sizes, lambda text: stderr.print(text, markup=False))
        title = f"Start-up: {escape(config.model)}, a fresh process per start, later: median of {sizes.trials}"
        return Report([ReportTable("load.csv", title, bench.columns(), rows, caption=bench.caption(skipped))])

    # The model loads in processes of their own: an allocation failure there is theirs to report.
    run_bench(out, lambda: sizes_for(quick, bench.FULL, bench.QUICK, trials=trials), measure, smaller=None)


@bench_app.command(cls=Command)
def serve(
    conversations: options.ConversationsOption = None,
    turns: options.ServeTurnsOption = None,
    max_new_tokens: options.MaxTokensOption = None,
    window: options.ServeWindowOption = None,
    n_ctx: options.NCtxOption = None,
    llama_server: options.LlamaServerOption = None,
    context_shift: options.ContextShiftOption = False,
    time_limit: options.TimeLimitOption = None,
    model: ModelOption = None,
    keep: KeepOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    out: options.OutOption = options.DEFAULT_OUT,
    quick: options.QuickOption = False,
) -> None:
    """The HTTP API as clients use it: C conversations of T turns, the whole history resent every turn.

    Starts `streamchat serve` (with the model options given), then llama.cpp's server on the
    same GGUF when installed (llama-cpp-python[server], or --llama-server PATH), each afresh
    for every row, on 127.0.0.1. Per row: generated tokens/s over all conversations, time to
    first token early (turns 2-11) and late (the last 10), prompt tokens sent and read per
    turn, errors and empty replies.
    """
    from streamchat.bench import serve as bench

    def sizes() -> bench.ServeSizes:
        given = {
            "conversations": bench.parse_conversations(conversations),
            "turns": turns,
            "max_new_tokens": max_new_tokens,
            "window": window,
            "n_ctx": n_ctx,
            "time_limit": time_limit,
        }
        return sizes_for(quick, bench.FULL, bench.QUICK, **given)

    def measure(sizes: bench.ServeSizes) -> Report:
        choice = ModelChoice(model, device, dtype, quantize, kv_cache=kv_cache)
        config = choice.config(keep=keep, window=sizes.window)
        model_options = bench.serve_options(**choice.given(), keep=keep, window=sizes.window)
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
        return Report(
            [ReportTable("serve.csv", title, bench.columns(), rows, caption=caption)],
            {"serve-requests.csv": (bench.REQUEST_COLUMNS, requests)},
            {"serve-ttft.png": bench.draw_ttft(requests)},
        )

    # The servers run in processes of their own: an allocation failure there is theirs to report.
    run_bench(out, sizes, measure, smaller=None)
