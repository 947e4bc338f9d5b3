"""The app's commands: `run`, `info`, `models` and `sessions` (streamchat.cli mounts them).

Each parses its options, builds a validated RunConfig and hands over; the options that
`bench` shares are declared once, in streamchat.interface.options.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Annotated

import typer
from rich.console import Console
from rich.text import Text

from streamchat import defaults
from streamchat.app.launch import announce_load, load, run_chat
from streamchat.app.listings import (
    cache_note,
    catalog_record,
    model_summary,
    models_table,
    session_record,
    sessions_table,
)
from streamchat.app.resuming import with_saved_layout
from streamchat.app.tensor_parallel import run_tensor_parallel, wants_tensor_parallel
from streamchat.interface.config import chosen_options, config_file_location, load_options, load_run_config
from streamchat.interface.options import (
    CACHE_PANEL,
    AllowPickleOption,
    DeviceMapOption,
    DeviceOption,
    DtypeOption,
    KeepOption,
    KvCacheOption,
    ModelOption,
    QuantizeOption,
    RecallOption,
    TpOption,
    TrustRemoteCodeOption,
    WindowOption,
    given_options,
    listed,
    option,
)
from streamchat.interface.reporting import reported_errors, stderr
from streamchat.interface.safe_text import safe_text
from streamchat.interface.tables import print_table
from streamchat.interface.transcript import OUTPUT_FORMATS, TRANSCRIPT_FORMATS, TURN_SPLITS
from streamchat.loading.catalog import model_catalog
from streamchat.loading.conversion import cache_root, cached_model_bytes
from streamchat.sessions.keeping import data_dir
from streamchat.storage.session_file import list_sessions

stdout = Console(highlight=False, emoji=False)

RUN_EPILOG = (
    "Every option can also be set in the config file "
    f"({config_file_location(os.environ)}, e.g. window = 4000) or as an environment variable "
    "(STREAMCHAT_WINDOW=4000); the command line wins. In the chat, /help lists the commands."
)
GENERATION, DISPLAY, TRANSCRIPT, SESSION = "Generation", "Display", "Transcript", "Session"
CACHE = CACHE_PANEL

JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of a table.")]


def models(as_json: JsonOption = False) -> None:
    """List the model aliases, what each resolves to, and which load offline right now."""
    with reported_errors():
        entries = model_catalog()
    if as_json:
        typer.echo(json.dumps([catalog_record(entry) for entry in entries], indent=2, ensure_ascii=False))
    else:
        print_table(stdout, models_table(entries))
        note = cache_note(cache_root(), cached_model_bytes())
        if note is not None:
            stderr.print(note)


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


def info(
    context: typer.Context,
    model: ModelOption = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    device_map: DeviceMapOption = None,
    trust_remote_code: TrustRemoteCodeOption = None,
    allow_pickle: AllowPickleOption = None,
) -> None:
    """Load a model and print a summary of it (options as for `run`, also from the config file and environment)."""
    with reported_errors():
        config = load_run_config(given_options(context))
    announce_load(config.model)
    print_table(stdout, model_summary(load(load_options(config)), config.window))


def run(
    context: typer.Context,
    model: ModelOption = None,
    keep: KeepOption = None,
    window: WindowOption = None,
    eviction: Annotated[
        str | None,
        option(
            f"{listed(defaults.EVICTION_POLICIES)}. token: evict just what each step needs (keeps the most "
            "context). turn: reserve room for the prompt and the whole reply before each turn (the paper's demo). "
            f"\\[default: {defaults.EVICTION_POLICY}]",
            "--eviction",
            "--evict",
            panel=CACHE,
            metavar="POLICY",
        ),
    ] = None,
    recall: RecallOption = None,
    read_all: Annotated[
        bool | None,
        option(
            "A message longer than the cache holds: --read-tail reads its start and its last two windows "
            "(the model could not see the rest anyway); --read-all streams every token, with progress. "
            "\\[default: --read-tail]",
            "--read-all/--read-tail",
            panel=CACHE,
            metavar="",
        ),
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        option(
            f"Longest reply, in tokens. \\[default: the model's, else {defaults.MAX_NEW_TOKENS}]",
            panel=GENERATION,
            metavar="N",
        ),
    ] = None,
    temperature: Annotated[
        float | None, option("0 is greedy. \\[default: the model's, else 0.7]", panel=GENERATION, metavar="NUMBER")
    ] = None,
    top_p: Annotated[
        float | None,
        option("Nucleus sampling: keep the likeliest tokens up to this mass.", panel=GENERATION, metavar="NUMBER"),
    ] = None,
    top_k: Annotated[
        int | None, option("Keep the N likeliest tokens (0 = off).", panel=GENERATION, metavar="N")
    ] = None,
    min_p: Annotated[
        float | None,
        option("Drop tokens below min-p times the likeliest's probability.", panel=GENERATION, metavar="NUMBER"),
    ] = None,
    repetition_penalty: Annotated[
        float | None, option("Above 1 discourages tokens already in the cache.", panel=GENERATION, metavar="NUMBER")
    ] = None,
    frequency_penalty: Annotated[
        float | None,
        option(
            "-2 to 2: subtracted from a token's logit once for each time the reply used it (OpenAI's; 0 = off).",
            panel=GENERATION,
            metavar="NUMBER",
        ),
    ] = None,
    presence_penalty: Annotated[
        float | None,
        option(
            "-2 to 2: subtracted from the logit of each token the reply already used (OpenAI's; 0 = off).",
            panel=GENERATION,
            metavar="NUMBER",
        ),
    ] = None,
    seed: Annotated[int | None, option("Seed for reproducible sampling.", panel=GENERATION, metavar="N")] = None,
    stop: Annotated[
        list[str] | None,
        option("End a reply where this text appears (repeat for several).", panel=GENERATION, metavar="TEXT"),
    ] = None,
    system: Annotated[str | None, option("System prompt.", panel=GENERATION, metavar="TEXT")] = None,
    json_schema: Annotated[
        str | None,
        option(
            "Every reply is one JSON value that this JSON schema file describes (constrained decoding; "
            '{"type": "object"} for any object).',
            panel=GENERATION,
            metavar="FILE",
        ),
    ] = None,
    device: DeviceOption = None,
    dtype: DtypeOption = None,
    quantize: QuantizeOption = None,
    kv_cache: KvCacheOption = None,
    device_map: DeviceMapOption = None,
    tp: TpOption = None,
    compile: Annotated[
        str | None,
        option(
            f"Compile the decode step into one graph (CUDA graphs on a GPU): {listed(defaults.COMPILE_SETTINGS)}. "
            "auto: on for CUDA, off on CPU, where it does not pay. The first start compiles for a minute or so; "
            f"later starts reuse the compiled code. \\[default: {defaults.COMPILE}]",
            metavar="MODE",
        ),
    ] = None,
    trust_remote_code: TrustRemoteCodeOption = None,
    allow_pickle: AllowPickleOption = None,
    markdown: Annotated[
        bool | None, option("Render replies as Markdown.", "--markdown/--plain", panel=DISPLAY, metavar="")
    ] = None,
    transcript: Annotated[
        str | None,
        option(
            "Read user turns from FILE instead of the prompt ('example' plays a shipped sample). "
            "Without it, turns come from stdin when stdin or stdout is not a terminal.",
            panel=TRANSCRIPT,
            metavar="FILE",
        ),
    ] = None,
    transcript_format: Annotated[
        str | None,
        option(
            f"How the transcript file is read: {listed(TRANSCRIPT_FORMATS)}. \\[default: {defaults.TRANSCRIPT_FORMAT}]",
            panel=TRANSCRIPT,
            metavar="FORMAT",
        ),
    ] = None,
    turns: Annotated[
        str | None,
        option(
            f"Plain text: {listed(TURN_SPLITS)}, one turn per line or turns separated by blank lines. "
            f"\\[default: {defaults.TRANSCRIPT_TURNS}]",
            panel=TRANSCRIPT,
            metavar="SPLIT",
        ),
    ] = None,
    output_format: Annotated[
        str | None,
        option(
            f"How the transcript is written to stdout: {listed(OUTPUT_FORMATS)}. \\[default: {defaults.OUTPUT_FORMAT}]",
            panel=TRANSCRIPT,
            metavar="FORMAT",
        ),
    ] = None,
    continue_: Annotated[
        bool | None,
        option(
            "Go on with the most recent conversation, exactly where it stopped (its saved cache state, else a "
            "replay). Its settings and system prompt come with it, and its --keep and --window unless given.",
            "--continue",
            panel=SESSION,
            metavar="",
        ),
    ] = None,
    resume: Annotated[
        str | None,
        option(
            "Go on with this conversation: a session file, or its id (see `streamchat sessions`); as --continue.",
            panel=SESSION,
            metavar="FILE|ID",
        ),
    ] = None,
) -> None:
    """Chat with a model, forever: every turn streams through one sink + window cache."""
    with reported_errors():
        given = given_options(context)
        # Before --tp hands the configuration to its ranks: every rank lays out its cache the same way.
        config = with_saved_layout(load_run_config(given), chosen_options(given))
    try:
        with reported_errors():
            code = run_tensor_parallel(config, load) if wants_tensor_parallel(config) else run_chat(config, load)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, and keep Python from complaining at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    raise typer.Exit(code)
