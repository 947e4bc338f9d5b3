"""`streamchat bench load`: how long a model takes to start, the memory its start peaks at, the disk it adds.

Each start is a fresh process running `streamchat info` with the model options given, which loads
the model exactly as `run` does (app/launch.py's load: the same resolution, conversion, placement and
quantization, the config file and the environment read alike), prints a summary of it and exits.
A start's seconds run from the process's start to the first byte of that summary: `run`'s time to its
first prompt (the interpreter, the imports, the load), less building the session, which runs no forward
pass. Its peak RSS is the process's own ru_maxrss, which os.wait4 reads as it ends (a process it started
and waited for counts where it peaked higher: a compiler building the CPU kernels). A small launcher
starts it and waits for it: Linux counts into a process's ru_maxrss the memory of whoever forked it (the
forked copy's peak, at exec), which from this process, torch imported, would be every start's floor.

The first start has streamchat's cache to itself, empty: $STREAMCHAT_CACHE_DIR is a new temporary
directory (under $TMPDIR) for the children, where a GGUF file's conversion and the CPU kernels go. The
later starts (--trials) reuse it, as every start after a user's first does. Disk added: the bytes of the
files the cache grew by during those starts.

Beside it, where llama-cpp-python is installed and the model is a GGUF file, llama.cpp loads the same
file in a fresh process as often (n_ctx 2048, every core), timed from the process's start to the model
loaded. It reads the file in place and keeps no cache, so each of its starts is a later one.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.errors import (
    ConfigError,
    ModelAccessError,
    ModelNotFoundError,
    OutOfMemoryError,
    StreamchatError,
    UnsupportedModelError,
)
from streamchat.measure.llama_cpp import llama_cpp_gguf, load_command
from streamchat.measure.report import Column, Row

if TYPE_CHECKING:
    from streamchat.measure.models import ModelChoice

STREAMCHAT, LLAMA_CPP = "streamchat", "llama.cpp"
FIRST, LATER = "first", "later"
GB = 1e9
# The launcher: forks the command (its arguments after the report file's path), waits for it, and writes its
# exit code and ru_maxrss into the report file. Ctrl-C reaches the command, which ends; the launcher waits on.
_LAUNCHER = """\
import os, signal, sys
report, command = sys.argv[1], sys.argv[2:]
pid = os.fork()
if pid == 0:
    try:
        os.execvp(command[0], command)
    finally:
        os._exit(127)
signal.signal(signal.SIGINT, signal.SIG_IGN)
_, status, usage = os.wait4(pid, 0)
with open(report, "w") as file:
    file.write(f"{os.waitstatus_to_exitcode(status)} {usage.ru_maxrss}")
"""
# A child's domain error (its "error: ..." line) is raised again as the error its exit code names, so that the
# bench ends as the child did; any other failure (a crash, a signal) is a ConfigError, as a benchmark's server
# that exits is (measure/server_process.py).
_CHILD_ERRORS: dict[int, type[StreamchatError]] = {
    error.exit_code: error
    for error in (
        StreamchatError,
        ConfigError,
        ModelNotFoundError,
        ModelAccessError,
        UnsupportedModelError,
        OutOfMemoryError,
    )
}


@dataclass(frozen=True)
class LoadSizes:
    trials: int  # later starts of each engine

    def __post_init__(self) -> None:
        require_at_least("--trials", self.trials, 1)


FULL = LoadSizes(trials=defaults.LOAD_BENCH_TRIALS)
QUICK = LoadSizes(trials=1)


@dataclass(frozen=True)
class Start:
    """One start of a fresh process: seconds to the model loaded, and the process's peak RSS (bytes)."""

    seconds: float
    peak_rss: int


# ---- the children ------------------------------------------------------------------------------


def info_command(choice: ModelChoice) -> list[str]:
    """`python -m streamchat info` with the model options given (the others the child reads as `run` would)."""
    given = {"--model": choice.model, "--device": choice.device, "--dtype": choice.dtype, "--quantize": choice.quantize}
    options = [part for name, value in given.items() if value is not None for part in (name, value)]
    return [sys.executable, "-m", "streamchat", "info", *options]


def timed_start(command: Sequence[str], environment: Mapping[str, str], engine: str = STREAMCHAT) -> Start:
    """Run `command` until it ends: the seconds to its first byte on stdout (the model loaded), its peak RSS.

    A process that fails is the error its exit code names (streamchat's codes), with its last line on stderr.
    """
    if not hasattr(os, "wait4") or not hasattr(os, "fork"):
        raise ConfigError("bench load reads a process's peak memory with os.wait4, which this system lacks")
    with tempfile.TemporaryDirectory(prefix="streamchat-bench-start-") as scratch:
        errors, report = Path(scratch) / "stderr", Path(scratch) / "report"
        # -I -S: the launcher reads no site packages and no PYTHON* variables (its command does, as usual).
        launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(report), *command]
        with errors.open("wb") as stderr:
            started = time.perf_counter()
            try:
                process = subprocess.Popen(
                    launcher, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=dict(environment)
                )
            except OSError as error:
                raise ConfigError(f"cannot start {engine}: {error.strerror or error}") from None
            with process:
                output = process.stdout or BytesIO()  # a pipe: stdout=PIPE
                first = output.read(1)  # waits for the command's first byte, or its end
                seconds = time.perf_counter() - started
                output.read()  # the rest, so that the command never waits on a full pipe
        code, peak = _reported(report, process.returncode)
        if code != 0 or not first:
            raise _failure(engine, code, _last_line(errors))
    # Linux reports kilobytes, macOS bytes.
    return Start(seconds, peak if sys.platform == "darwin" else peak * 1024)


def _reported(report: Path, launcher_code: int) -> tuple[int, int]:
    """The command's exit code and ru_maxrss, as the launcher wrote them; the launcher's exit code, and no peak,
    where it wrote none (it could not start or wait for the command)."""
    try:
        code, peak = report.read_text().split()
        return int(code), int(peak)
    except (OSError, ValueError):
        return launcher_code or 1, 0


def _failure(engine: str, code: int, last_line: str) -> StreamchatError:
    if code < 0:
        return ConfigError(f"{engine} was ended by signal {-code}: {last_line or 'it wrote nothing on stderr'}")
    if engine == STREAMCHAT and code in _CHILD_ERRORS and last_line.startswith("error: "):
        return _CHILD_ERRORS[code](last_line.removeprefix("error: "))
    ended = f"exited with code {code}" if code else "wrote nothing on stdout"
    return ConfigError(f"{engine} {ended}: {last_line or 'and nothing on stderr'}")


def _last_line(errors: Path) -> str:
    lines = errors.read_bytes().decode(errors="replace").strip().splitlines()
    return lines[-1].strip() if lines else ""


def directory_bytes(root: Path) -> int:
    """The bytes of every file under `root` (links not followed); 0 where it does not exist."""
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            with suppress(OSError):  # removed while walking: a partial conversion swept
                total += os.lstat(os.path.join(folder, name)).st_size
    return total


# ---- the measurement ---------------------------------------------------------------------------


def measure(
    choice: ModelChoice, model: str, sizes: LoadSizes, say: Callable[[str], None] = lambda text: None
) -> tuple[list[Row], str | None]:
    """streamchat's first start (an empty cache), then its later starts and llama.cpp's, taking turns, for the
    model options `choice` holds (`model`: the model they name); the rows, and why llama.cpp has none (None where
    it has)."""
    child = info_command(choice)
    with tempfile.TemporaryDirectory(prefix="streamchat-bench-load-") as scratch:
        cache = Path(scratch) / "cache"
        environment = {**os.environ, defaults.CACHE_DIR_ENV: str(cache)}
        first = timed_start(child, environment)
        first_added = directory_bytes(cache)
        say(describe(STREAMCHAT, FIRST, first, first_added))
        # Only now: a model that does not load is the child's one-line error above, whatever llama.cpp could do.
        gguf, skipped = llama_cpp_gguf(model)
        later: list[Start] = []
        llama: list[Start] = []
        for _ in range(sizes.trials):
            before = directory_bytes(cache)
            later.append(timed_start(child, environment))
            say(describe(STREAMCHAT, LATER, later[-1], directory_bytes(cache) - before))
            if gguf is not None:
                llama.append(timed_start(load_command(gguf), os.environ, LLAMA_CPP))
                say(describe(LLAMA_CPP, LATER, llama[-1]))
        later_added = directory_bytes(cache) - first_added
    found = [row(STREAMCHAT, FIRST, [first], first_added), row(STREAMCHAT, LATER, later, later_added)]
    if llama:
        llama_row = row(LLAMA_CPP, LATER, llama)
        found = [*(with_ratios(measured, llama_row) for measured in found), llama_row]
    return found, skipped or None


def describe(engine: str, start: str, measured: Start, added: int | None = None) -> str:
    """One progress line: a start's seconds, peak RSS and what it added to the cache."""
    line = f"{engine} {start} start: {measured.seconds:.2f} s, peak RSS {measured.peak_rss / GB:.3f} GB"
    if added is None:
        return line
    return f"{line}, cache +{added / 2**20:,.1f} MiB" if added >= 2**20 else f"{line}, cache +{added:,} bytes"


# ---- rows --------------------------------------------------------------------------------------


def columns() -> list[Column]:
    return [
        Column("engine", "engine"),
        Column("start", "start"),
        Column("starts", "starts"),
        Column("seconds", "seconds", "{:.2f}"),
        Column("peak_rss_gb", "peak RSS GB", "{:.3f}"),
        Column("disk_added_gb", "disk added GB", "{:.3f}"),
        Column("seconds_vs_llama_cpp", "x llama.cpp s", "{:.2f}"),
        Column("peak_rss_vs_llama_cpp", "x llama.cpp RSS", "{:.2f}"),
    ]


def row(engine: str, start: str, starts: list[Start], disk_added: int | None = None) -> Row:
    """Starts of one kind: the median seconds, the highest peak RSS, the disk they added (None: no cache)."""
    return {
        "engine": engine,
        "start": start,
        "starts": len(starts),
        "seconds": statistics.median(measured.seconds for measured in starts),
        "peak_rss_gb": max(measured.peak_rss for measured in starts) / GB,
        "disk_added_gb": None if disk_added is None else disk_added / GB,
    }


def with_ratios(measured: Row, llama: Row) -> Row:
    """A streamchat row with its seconds and peak RSS over llama.cpp's."""
    return measured | {
        "seconds_vs_llama_cpp": measured["seconds"] / llama["seconds"],
        "peak_rss_vs_llama_cpp": measured["peak_rss_gb"] / llama["peak_rss_gb"],
    }


def caption(skipped: str | None) -> str:
    """What the figures are, and why llama.cpp has no row where it has none."""
    what = (
        "seconds: from a fresh process's start to the model loaded (the median of the later starts); peak RSS: the "
        "process's own (wait4), the highest; disk added: bytes streamchat's cache grew by (a new, empty one at the "
        "first start); x llama.cpp: streamchat's figure over llama.cpp's later starts"
    )
    return f"{what}\n{escape(skipped)}" if skipped else what  # a caption is read as markup: [llamacpp] too
