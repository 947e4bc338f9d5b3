"""`streamchat bench serve`: the HTTP API as clients use it, streamchat's server against llama.cpp's.

C conversations side by side, T turns each, through a client that resends the whole
history every turn (measure/chat_client.py), against `streamchat serve` started here as a
subprocess, then against llama.cpp's server on the same GGUF when it is installed
(`python -m llama_cpp.server`, or a `llama-server` binary given by --llama-server). Each
(server, C) pair is a row, with a freshly started server: no row inherits another's cache.
A server is always stopped, whatever ends the run; streamchat's writes its conversations
into a temporary data directory, removed after, so the user's sessions stay as they were.
"""

from __future__ import annotations

import importlib.util
import os
import statistics
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.errors import ConfigError
from streamchat.loading.resolve import packaged_gguf
from streamchat.measure.chat_client import ListedModel, TurnRecord, Workload, run_conversations, served_model
from streamchat.measure.chat_client import Reply as TurnReply
from streamchat.measure.report import Column, Row
from streamchat.measure.server_process import HOST, ServerCommand, running

if TYPE_CHECKING:
    from matplotlib.figure import Figure

STREAMCHAT, LLAMA_CPP = "streamchat", "llama.cpp"
# Turns whose first-token times are "early" (from the second: the first reads only the system prompt) and
# how many last turns are "late".
EARLY_TURNS = range(2, 12)
LATE_TURNS = 10
# The packages `python -m llama_cpp.server` imports (llama-cpp-python[server]).
LLAMA_CPP_SERVER_MODULES = ("llama_cpp", "fastapi", "sse_starlette", "starlette_context", "pydantic_settings")


@dataclass(frozen=True)
class ServeSizes:
    conversations: tuple[int, ...]  # a row per value
    turns: int
    max_new_tokens: int
    n_ctx: int  # llama.cpp's context per conversation
    window: int | None = None  # streamchat's; None: as `serve` resolves it
    start_timeout: float = 300.0  # seconds for a server to answer its health check
    request_timeout: float = 300.0
    time_limit: float = defaults.SERVE_BENCH_TIME_LIMIT_SECONDS  # per row

    def __post_init__(self) -> None:
        if not self.conversations:
            raise ConfigError("--conversations: give at least one number, e.g. 1,2,4")
        for count in self.conversations:
            require_at_least("--conversations", count, 1)
        require_at_least("--turns", self.turns, 1)
        require_at_least("--max-new-tokens", self.max_new_tokens, 1)
        require_at_least("--n-ctx", self.n_ctx, 64)
        require_at_least("--time-limit", int(self.time_limit), 1)


FULL = ServeSizes(
    conversations=defaults.SERVE_BENCH_CONVERSATIONS,
    turns=defaults.SERVE_BENCH_TURNS,
    max_new_tokens=defaults.SERVE_BENCH_MAX_NEW_TOKENS,
    n_ctx=defaults.SERVE_BENCH_N_CTX,
)
QUICK = ServeSizes(
    conversations=(2,), turns=3, max_new_tokens=8, n_ctx=512, window=96, start_timeout=60, request_timeout=30
)


def parse_conversations(text: str | None) -> tuple[int, ...] | None:
    """ "1,2,4" -> (1, 2, 4); None when not given."""
    if text is None:
        return None
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--conversations {text}: give whole numbers separated by commas, e.g. 1,2,4") from None


# ---- the servers --------------------------------------------------------------------------------


def serve_options(**given: object) -> tuple[str, ...]:
    """`serve`'s options as typed, for those given: serve_options(model="m", window=None) -> ("--model", "m")."""
    return tuple(
        part
        for name, value in given.items()
        if value is not None
        for part in (f"--{name.replace('_', '-')}", str(value))
    )


def streamchat_server(model_options: Sequence[str], conversations: int) -> ServerCommand:
    """`python -m streamchat serve` with the bench's model options, room for every conversation live."""
    args = (
        sys.executable,
        "-m",
        "streamchat",
        "serve",
        *model_options,
        "--host",
        HOST,
        "--port",
        "{port}",
        "--max-conversations",
        str(max(conversations, defaults.SERVE_MAX_CONVERSATIONS)),
        "--max-waiting",
        str(max(conversations, defaults.SERVE_MAX_WAITING)),
    )
    return ServerCommand(STREAMCHAT, args, "/health")


def llama_cpp_server(
    gguf: Path, n_ctx: int, conversations: int, llama_server: Path | None, context_shift: bool
) -> ServerCommand:
    """llama.cpp's server on `gguf`: the binary (a slot of `n_ctx` per conversation) or llama-cpp-python's."""
    if llama_server is not None:
        command = [str(llama_server), "-m", str(gguf), "--port", "{port}", "--host", HOST]
        # The context is shared by the slots: each conversation gets n_ctx.
        command += ["-c", str(n_ctx * conversations), "-np", str(conversations)]
        if context_shift:
            command.append("--context-shift")
        # A build tree's binary finds its shared libraries beside it.
        library_path = os.pathsep.join(filter(None, [str(llama_server.parent), os.environ.get("LD_LIBRARY_PATH")]))
        return ServerCommand(LLAMA_CPP, tuple(command), "/health", (("LD_LIBRARY_PATH", library_path),))
    args = (sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", "{port}", "--host", HOST)
    return ServerCommand(LLAMA_CPP, (*args, "--n_ctx", str(n_ctx)), "/v1/models")


def llama_cpp_gguf(model: str, llama_server: Path | None) -> tuple[Path | None, str]:
    """The GGUF llama.cpp serves for `model`, or None and why there is no llama.cpp row."""
    if llama_server is None and not all(importlib.util.find_spec(name) for name in LLAMA_CPP_SERVER_MODULES):
        return None, (
            "llama.cpp row skipped: neither llama-cpp-python's server (pip install 'llama-cpp-python[server]') "
            "nor --llama-server PATH is available"
        )
    if llama_server is not None and not llama_server.is_file():
        return None, f"llama.cpp row skipped: --llama-server {llama_server} is not a file"
    if model.endswith(".gguf"):
        return Path(model).expanduser(), ""
    if model != defaults.DEFAULT_MODEL:
        return None, f"llama.cpp row skipped: {model} is not a GGUF file"
    gguf = packaged_gguf(defaults.DEFAULT_MODEL)
    return (gguf, "") if gguf is not None else (None, "llama.cpp row skipped: the default model is not installed")


def measure_row(
    server: ServerCommand, sizes: ServeSizes, conversations: int
) -> tuple[list[TurnRecord], float, ListedModel]:
    """One row: a fresh server, `conversations` side by side; the records, the wall seconds, what it serves."""
    workload = Workload(conversations, sizes.turns, sizes.max_new_tokens, sizes.request_timeout, sizes.time_limit)
    stop = threading.Event()
    with running(server, sizes.start_timeout) as endpoint:
        listed = served_model(endpoint, sizes.request_timeout)
        try:
            return (*run_conversations(endpoint, listed.name, workload, stop), listed)
        finally:
            stop.set()  # on Ctrl-C, no conversation sends another turn to the server being stopped


@dataclass(frozen=True)
class Servers:
    """What runs: streamchat with the model options given, and llama.cpp when it has a GGUF."""

    model_options: tuple[str, ...]  # `serve`'s model and cache options, as typed
    keep: str  # streamchat's --keep, resolved
    gguf: Path | None = None
    llama_server: Path | None = None
    context_shift: bool = False

    def for_conversations(self, conversations: int, n_ctx: int) -> list[ServerCommand]:
        servers = [streamchat_server(self.model_options, conversations)]
        if self.gguf is not None:
            servers.append(llama_cpp_server(self.gguf, n_ctx, conversations, self.llama_server, self.context_shift))
        return servers


def measure(servers: Servers, sizes: ServeSizes, note: Callable[[str], None]) -> tuple[list[Row], list[Row]]:
    """A row per (conversations, server) and a CSV row per request. A llama.cpp server that fails to
    start loses its row, with a note; streamchat's failing is the bench's error."""
    rows: list[Row] = []
    requests: list[Row] = []
    for count in sizes.conversations:
        for server in servers.for_conversations(count, sizes.n_ctx):
            note(f"{server.name}: {count} conversation(s) x {sizes.turns} turns")
            try:
                records, seconds, listed = measure_row(server, sizes, count)
            except ConfigError as error:
                if server.name == STREAMCHAT:
                    raise
                note(f"llama.cpp row skipped: {error}")
                continue
            kept = system_prompt_kept(servers.keep) if server.name == STREAMCHAT else None
            rows.append(summary_row(server.name, count, sizes.turns, records, seconds, kept) | kv_figures(listed.meta))
            requests += request_rows(server.name, count, records)
            note(describe(rows[-1], seconds))
    against_one(rows)
    return rows, requests


# ---- figures ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], fraction: float) -> float | None:
    """The `fraction` quantile of `values`, linearly interpolated; None for none."""
    ordered = sorted(values)
    if not ordered:
        return None
    position = fraction * (len(ordered) - 1)
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def late_turns(turns: int) -> range:
    """The last LATE_TURNS turns, from the second at the earliest."""
    return range(max(2, turns - LATE_TURNS + 1), turns + 1) if turns > 1 else range(1, 2)


def system_prompt_kept(keep: str) -> str:
    """What streamchat keeps of the system prompt as the window rolls (--keep)."""
    return "kept" if keep == defaults.KEEP_SYSTEM else f"first {keep} tokens kept"


def columns() -> list[Column]:
    return [
        Column("server", "server"),
        Column("conversations", "conversations", "{:d}"),
        Column("requests", "requests", "{:d}"),
        Column("errors", "errors", "{:d}"),
        Column("empty", "empty", "{:d}"),
        Column("first_failed_turn", "first failed turn", "{:d}"),
        Column("tokens_per_second", "tok/s (all)", "{:.1f}"),
        Column("throughput_vs_one", "x one conv.", "{:.2f}"),
        Column("decode_each", "decode tok/s each", "{:.1f}"),
        Column("decode_each_vs_alone", "each vs alone", "{:.0%}"),
        Column("ttft_p50", "TTFT p50 s", "{:.3f}"),
        Column("ttft_p95", "TTFT p95 s", "{:.3f}"),
        Column("ttft_early_p50", "TTFT p50 early s", "{:.3f}"),
        Column("ttft_early_p95", "TTFT p95 early s", "{:.3f}"),
        Column("ttft_late_p50", "TTFT p50 late s", "{:.3f}"),
        Column("ttft_late_p95", "TTFT p95 late s", "{:.3f}"),
        Column("prompt_late", "prompt/turn late", "{:.0f}"),
        Column("read_late", "read/turn late", "{:.0f}"),
        Column("system_prompt", "system prompt"),
        Column("kv_cache", "KV cache"),
        Column("kv_mb_full", "KV MB/token full", "{:.1f}"),
        Column("last_cache", "cache at the last request"),
    ]


def summary_row(
    server: str, conversations: int, turns: int, records: list[TurnRecord], seconds: float, system_prompt: str | None
) -> Row:
    """A row's figures: throughput over the row's wall time, first-token times early and late, tokens read."""
    early = [r.reply.ttft for r in records if r.turn in EARLY_TURNS and r.reply.ttft is not None]
    late_range = late_turns(turns)
    late = [r.reply for r in records if r.turn in late_range]
    late_ttft = [reply.ttft for reply in late if reply.ttft is not None]
    prompts = [reply.prompt_tokens for reply in late if reply.prompt_tokens is not None]
    reads = [reply.read_tokens for reply in late if reply.read_tokens is not None]
    every_ttft = [r.reply.ttft for r in records if r.reply.ttft is not None]
    decoding = [speed for speed in (decode_speed(r.reply) for r in records) if speed is not None]
    failed = [r.turn for r in records if r.reply.error is not None or r.reply.empty]
    caches = [r.reply.cache for r in records if r.reply.cache]
    return {
        "server": server,
        "conversations": conversations,
        "requests": len(records),
        "errors": sum(r.reply.error is not None for r in records),
        "empty": sum(r.reply.empty for r in records),
        "first_failed_turn": min(failed) if failed else None,
        "tokens_per_second": sum(r.reply.tokens for r in records) / seconds if seconds > 0 else None,
        "decode_each": statistics.median(decoding) if decoding else None,
        "ttft_p50": percentile(every_ttft, 0.5),
        "ttft_p95": percentile(every_ttft, 0.95),
        "ttft_early_p50": percentile(early, 0.5),
        "ttft_early_p95": percentile(early, 0.95),
        "ttft_late_p50": percentile(late_ttft, 0.5),
        "ttft_late_p95": percentile(late_ttft, 0.95),
        "prompt_late": statistics.fmean(prompts) if prompts else None,
        "read_late": statistics.fmean(reads) if reads else None,
        "system_prompt": system_prompt,
        "last_cache": caches[-1] if caches else None,
    }


def kv_figures(meta: dict[str, Any]) -> Row:
    """What a server's /v1/models says of its caches (streamchat's meta): the KV format, and the megabytes of keys
    and values a conversation's decode step reads at a full window."""
    token_bytes, window = meta.get("kv_token_bytes"), meta.get("window")
    full = token_bytes * window / 1e6 if isinstance(token_bytes, int) and isinstance(window, int) else None
    return {"kv_cache": meta.get("kv_cache"), "kv_mb_full": full}


def decode_speed(reply: TurnReply) -> float | None:
    """A reply's own decode speed: its tokens after the first over the time after the first; None if too short."""
    if reply.error is not None or reply.ttft is None or reply.tokens < 2 or reply.seconds <= reply.ttft:
        return None
    return (reply.tokens - 1) / (reply.seconds - reply.ttft)


def against_one(rows: list[Row]) -> None:
    """Each row's throughput and per-conversation decode speed against its server's one-conversation row."""
    alone = {row["server"]: row for row in rows if row["conversations"] == 1}
    for row in rows:
        one = alone.get(row["server"])
        if one is None:
            continue
        if row["tokens_per_second"] and one["tokens_per_second"]:
            row["throughput_vs_one"] = row["tokens_per_second"] / one["tokens_per_second"]
        if row["decode_each"] and one["decode_each"]:
            row["decode_each_vs_alone"] = row["decode_each"] / one["decode_each"]


def describe(row: Row, seconds: float) -> str:
    """A row in one progress line: "  in 81.2 s: 31.5 tok/s, 0 errors, 0 empty replies"."""
    rate = row["tokens_per_second"]
    shown = "no" if rate is None else f"{rate:.1f}"
    return f"  in {seconds:.1f} s: {shown} tok/s, {row['errors']} errors, {row['empty']} empty replies"


REQUEST_COLUMNS = (
    "server",
    "conversations",
    "conversation",
    "turn",
    "ttft_s",
    "seconds",
    "tokens",
    "prompt_tokens",
    "cached_tokens",
    "read_tokens",
    "empty",
    "cache",
    "error",
)


def request_rows(server: str, conversations: int, records: list[TurnRecord]) -> list[Row]:
    """A CSV row per request."""
    return [
        {
            "server": server,
            "conversations": conversations,
            "conversation": record.conversation,
            "turn": record.turn,
            "ttft_s": record.reply.ttft,
            "seconds": record.reply.seconds,
            "tokens": record.reply.tokens,
            "prompt_tokens": record.reply.prompt_tokens,
            "cached_tokens": record.reply.cached_tokens,
            "read_tokens": record.reply.read_tokens,
            "empty": int(record.reply.empty),
            "cache": record.reply.cache,
            "error": record.reply.error,
        }
        for record in records
    ]


def draw_ttft(requests: list[Row]) -> Callable[[Figure], None]:
    """The median time to first token at each turn, a line per (server, conversations)."""

    def draw(figure: Figure) -> None:
        axes = figure.add_subplot()
        lines: dict[tuple[str, int], dict[int, list[float]]] = {}
        for row in requests:
            if row["ttft_s"] is not None:
                by_turn = lines.setdefault((row["server"], row["conversations"]), {})
                by_turn.setdefault(row["turn"], []).append(row["ttft_s"])
        for (server, conversations), by_turn in lines.items():
            turns = sorted(by_turn)
            axes.plot(
                turns, [statistics.median(by_turn[t]) for t in turns], marker=".", label=f"{server}, {conversations}"
            )
        axes.set_xlabel("turn")
        axes.set_ylabel("time to first token, median (s)")
        axes.set_yscale("log")
        axes.grid(alpha=0.3)
        axes.legend(title="server, conversations")

    return draw
