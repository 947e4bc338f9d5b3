"""The benches' options, declared once: --out and --quick, sizes that fall back on the bench's, each bench's inputs.

The model options are `run`'s (streamchat.interface.options). A size option's Typer default is None, so that a
bench tells a size given from one left to --quick; its help shows the full size. sizes_for: the full sizes or the
--quick ones, with the sizes given.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any, ClassVar, Protocol, TypeVar

import typer

from streamchat import defaults
from streamchat.errors import ConfigError

DEFAULT_OUT = Path(defaults.BENCH_OUT_DIR)
WINDOW_HELP = "Recent tokens kept in the rolling window."


class _Dataclass(Protocol):
    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]


# A frozen dataclass of sizes (PplSizes, SpeedSizes) that validates itself when built.
Sizes = TypeVar("Sizes", bound=_Dataclass)


def sizes_for(quick: bool, full: Sizes, quick_sizes: Sizes, **options: object) -> Sizes:
    """`quick_sizes` or `full`, with every option that was given (not None) in place of its default."""
    given = {name: value for name, value in options.items() if value is not None}
    return dataclasses.replace(quick_sizes if quick else full, **given)


def require_at_least(option: str, value: int, least: int) -> None:
    """Refuse `option` (as typed on the command line) when `value` is below `least`."""
    if value < least:
        raise ConfigError(f"{option} {value}: must be at least {least}")


def size_option(help_text: str, default: object, *names: str, metavar: str = "N") -> Any:
    """An option that falls back to the full size (or the --quick one) when not given."""
    return typer.Option(*names, help=f"{help_text} \\[default: {default}]", show_default=False, metavar=metavar)


def keep_option(default: int) -> Any:
    """The first tokens the streaming cache keeps forever, spelled as `run --keep N`; --sinks is its earlier name."""
    return size_option("First tokens kept forever (attention sinks), as `run --keep N`.", default, "--keep", "--sinks")


def window_option(default: int) -> Any:
    return size_option(WINDOW_HELP, default)


def listed(values: tuple[int, ...]) -> str:
    """(1, 2, 4) -> "1,2,4": a list option's default as it is typed."""
    return ",".join(map(str, values))


def input_file(help_text: str, *names: str, metavar: str = "FILE") -> Any:
    return typer.Option(*names, help=help_text, show_default=False, metavar=metavar)


# Every bench.
OutOption = Annotated[Path, typer.Option("--out", help="Directory for the CSV files and the plot.", metavar="DIR")]
QuickOption = Annotated[
    bool, typer.Option("--quick", help="Toy sizes that finish in seconds; options given still apply. A smoke test.")
]
# speed and decode: the chat's cache by default, a loaded model or random weights.
ChatKeepOption = Annotated[int | None, keep_option(defaults.SINKS)]
ChatWindowOption = Annotated[int | None, window_option(defaults.WINDOW)]
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

# ppl.
TextOption = Annotated[Path, input_file("A long UTF-8 text, e.g. a Gutenberg novel.")]
FromOption = Annotated[
    str | None,
    input_file("Start scoring where this text first appears (skip a book's front matter).", "--from", metavar="TEXT"),
]
PplTokensOption = Annotated[int | None, size_option("Tokens of the text to score.", defaults.PPL_TOKENS)]
PplKeepOption = Annotated[int | None, keep_option(defaults.PPL_SINKS)]
PplWindowOption = Annotated[int | None, window_option(defaults.PPL_WINDOW)]
ChunkOption = Annotated[
    int | None, size_option("Tokens per forward pass for window, recompute and streaming.", defaults.PPL_CHUNK)
]
PoliciesOption = Annotated[
    str | None, size_option(f"Comma-separated, from {','.join(defaults.BENCH_POLICIES)}.", "all", metavar="LIST")
]
LongerKeepOption = Annotated[
    int | None,
    size_option(
        "The keep policy's kept prefix (first tokens, a system turn's worth), in a cache as large as "
        "--keep + --window. It was --keep here before; --keep now means streaming's kept tokens, as for `run`.",
        defaults.PPL_KEEP,
    ),
]

# speed.
CheckpointsOption = Annotated[
    str | None,
    size_option(
        "Tokens streamed before each measurement, comma-separated.", listed(defaults.SPEED_CHECKPOINTS), metavar="LIST"
    ),
]
StepsOption = Annotated[
    int | None, size_option("Decode steps timed per policy at each checkpoint.", defaults.SPEED_STEPS)
]

# keep.
TranscriptOption = Annotated[
    Path,
    input_file("User turns to stream: MT-bench's questions, JSONL chat lines or plain lines (as `run` reads them)."),
]
KeepTurnsOption = Annotated[
    int | None, size_option("User turns streamed before the last probe.", defaults.KEEP_BENCH_TURNS)
]
KeepWindowOption = Annotated[int | None, window_option(defaults.KEEP_BENCH_WINDOW)]
KeepReplyTokensOption = Annotated[int | None, size_option("Longest generated reply.", defaults.KEEP_BENCH_REPLY_TOKENS)]

# recall.
RecallWindowOption = Annotated[int | None, window_option(defaults.RECALL_BENCH_WINDOW)]
RecallReplyTokensOption = Annotated[
    int | None, size_option("Longest generated filler reply.", defaults.RECALL_BENCH_REPLY_TOKENS)
]
FactsOption = Annotated[int | None, size_option("Facts stated (of those shipped).", defaults.RECALL_BENCH_FACTS)]
FillerOption = Annotated[
    Path | None,
    input_file("MT-bench's question.jsonl for the filler turns, when there is one; else the questions shipped."),
]

# display: no --quick sizes; the window also from the environment and the config file, as for `run`.
DisplayTrialsOption = Annotated[int, typer.Option(help="Replies per side (the median counts).", metavar="N")]
DisplayTokensOption = Annotated[int, typer.Option(help="Tokens per reply.", metavar="N")]
DisplayWindowOption = Annotated[
    int | None,
    size_option(f"{WINDOW_HELP} As for `run`, also from the environment and config file.", defaults.WINDOW),
]

# decode.
DecodeTokensOption = Annotated[int | None, size_option("Tokens per reply.", defaults.DECODE_BENCH_TOKENS)]
DecodeTrialsOption = Annotated[
    int | None, size_option("Replies per row (the median counts).", defaults.DECODE_BENCH_TRIALS)
]
FullCacheOption = Annotated[
    bool, typer.Option("--full-cache", help="Fill the cache before the reply: every step reads the whole window.")
]
CompiledOption = Annotated[
    bool, typer.Option("--compiled/--no-compiled", help="Also time the compiled decode step (compiles first, untimed).")
]
BaselineOption = Annotated[
    bool,
    typer.Option(
        "--baseline/--no-baseline",
        help="On CPU, also time the model in float32 unquantized, where its weights (4 bytes a parameter) fit in "
        "the memory available.",
    ),
]

# serve.
ConversationsOption = Annotated[
    str | None,
    size_option(
        "Conversations side by side, comma-separated: a row per value.",
        listed(defaults.SERVE_BENCH_CONVERSATIONS),
        metavar="LIST",
    ),
]
ServeTurnsOption = Annotated[int | None, size_option("User turns per conversation.", defaults.SERVE_BENCH_TURNS)]
MaxTokensOption = Annotated[
    int | None, size_option("Most tokens per reply (max_tokens).", defaults.SERVE_BENCH_MAX_NEW_TOKENS)
]
ServeWindowOption = Annotated[
    int | None,
    size_option(
        "Recent tokens streamchat's cache keeps, as `serve --window`; also from the environment and config file.",
        defaults.WINDOW,
    ),
]
NCtxOption = Annotated[
    int | None, size_option("llama.cpp's context per conversation, in tokens.", defaults.SERVE_BENCH_N_CTX)
]
LlamaServerOption = Annotated[
    Path | None,
    input_file(
        "A llama.cpp `llama-server` binary to run instead of llama-cpp-python's server.",
        "--llama-server",
        metavar="PATH",
    ),
]
ContextShiftOption = Annotated[
    bool, typer.Option("--context-shift", help="Start llama-server with --context-shift (past n_ctx: shift).")
]
TimeLimitOption = Annotated[
    int | None,
    size_option(
        "Seconds each row may run; turns not sent by then are errors.", defaults.SERVE_BENCH_TIME_LIMIT_SECONDS
    ),
]

# load.
LoadTrialsOption = Annotated[
    int | None,
    size_option("Later starts of each engine, after the first (the median counts).", defaults.LOAD_BENCH_TRIALS),
]
