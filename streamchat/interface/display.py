"""Rich rendering of the engine's events: the streaming reply, evictions, and a live cache panel.

While a reply streams, finished lines scroll up as plain text and a live area at the
bottom holds the line being written, the latest eviction and the occupancy bar. The
display only renders; it never drives the engine. Rich honours NO_COLOR and narrow
terminals by itself; the bar keeps distinct characters so it reads without colour.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.markdown import Markdown
from rich.table import Table
from rich.text import Text

from streamchat.cache.ledger import CacheStats
from streamchat.generation.events import (
    CacheOccupancy,
    Compiled,
    Compiling,
    Event,
    Evicted,
    NotResumed,
    PromptProgress,
    PromptSkipped,
    PromptTruncated,
    Recalled,
    Replayed,
    Resumed,
    TextDelta,
    TurnFinished,
    TurnStats,
)
from streamchat.interface.safe_text import safe_plain, safe_text
from streamchat.interface.status import BAR_CHARACTERS, bar_segments, first_words, fit_status, last_words

SEGMENT_STYLES = {"sinks": "magenta", "window": "cyan", "free": "bright_black"}
# Redraws of the live area, at most; drawn between tokens on the main thread (no refresh
# thread competing with generation for the GIL).
REFRESH_PER_SECOND = 12


@dataclass
class _TurnEvictions:
    """What one turn forgot: how much, which stream indices, and where its text begins and ends."""

    count: int = 0
    first_index: int = -1
    last_index: int = -1
    head: str = ""
    tail: str = ""

    KEEP = 120  # characters of text kept at each end

    def add(self, event: Evicted) -> None:
        if not self.count:
            self.first_index = event.first_index
        self.count += event.count
        self.last_index = event.last_index
        if len(self.head) < self.KEEP:
            self.head = (self.head + event.text)[: self.KEEP]
        self.tail = (self.tail + event.text)[-self.KEEP :]

    def preview(self, width: int) -> str:
        """The forgotten text in one line: all of it if short, else its beginning and its end."""
        head, tail = " ".join(self.head.split()), " ".join(self.tail.split())
        if len(self.head) < self.KEEP and len(head) <= width:
            return head
        half = max(8, (width - 3) // 2)
        return f"{first_words(head, half)} … {last_words(tail, half)}"


class ChatDisplay:
    """Renders one conversation's events on a console (stdout when chatting, stderr when piped)."""

    def __init__(self, console: Console, *, show_text: bool = True, markdown: bool = False) -> None:
        self.console = console
        self.show_text = show_text
        self.markdown = markdown
        self.stats: CacheStats | None = None
        self.speed = 0.0
        self._live: Live | None = None
        self._partial = ""
        self._reply = ""
        self._evictions = _TurnEvictions()
        self._reading: PromptProgress | None = None  # a long prompt being read
        self._skipped = False  # this turn's prompt was read in part, and the user was told

    # ---- a turn -----------------------------------------------------------------------------

    def show(self, events: Iterable[Event]) -> None:
        """Render events as they come, with the live panel up while they last."""
        self._partial, self._reply, self._evictions = "", "", _TurnEvictions()
        self._reading, self._skipped = None, False
        self.speed = 0.0
        with Live(
            self,
            console=self.console,
            transient=True,
            auto_refresh=False,
            redirect_stdout=False,
            redirect_stderr=False,
        ) as live:
            self._live = live
            drawn = 0.0
            try:
                for event in events:
                    self.handle(event)
                    if time.monotonic() - drawn >= 1 / REFRESH_PER_SECOND:
                        live.refresh()
                        drawn = time.monotonic()
            finally:
                self._live = None
        self._finish_text()

    def handle(self, event: Event) -> None:
        if isinstance(event, TextDelta):
            self._reading = None
            self._add_text(event.text)
        elif isinstance(event, PromptProgress):
            starting = self._reading is None
            self._reading = event if event.read_tokens < event.total_tokens else None
            if starting and self._reading is not None and self._live is not None:
                self._live.refresh()  # the next forward pass may take long: show the read before it
        elif isinstance(event, PromptSkipped):
            self._reading, self._skipped = None, True
            self._print(Text(prompt_skipped_text(event), style="yellow"))
        elif isinstance(event, Evicted):
            self._evictions.add(event)
            self.stats = event.stats
        elif isinstance(event, CacheOccupancy):
            self.stats, self.speed = event.stats, event.decode_tokens_per_second
        elif isinstance(event, PromptTruncated) and not self._skipped:
            self._print(
                Text(
                    f"⚠ your message is {event.prompt_tokens:,} tokens, more than the cache holds: "
                    f"{event.dropped_tokens:,} from its beginning were dropped, the model sees the other "
                    f"{event.visible_tokens:,}",
                    style="yellow",
                )
            )
        elif isinstance(event, Recalled):
            self._print(Text(recalled_text(event), style="cyan"))
        elif isinstance(event, TurnFinished):
            self._turn_summary(event.stats)
        elif isinstance(event, Replayed):
            self._print(Text(f"replayed {event.messages} messages ({event.tokens:,} tokens)", style="dim"))
        elif isinstance(event, Resumed):
            self._print(Text(resumed_text(event), style="dim"))
        elif isinstance(event, NotResumed):
            self._print(Text.assemble(("not resumed exactly, replayed: ", "yellow"), safe_text(event.reason)))
        elif isinstance(event, Compiling):
            self._print(Text("compiling the decode step (once per start; later starts reuse the cache)…", style="dim"))
            if self._live is not None:
                self._live.refresh()  # the compile blocks: show the notice before it starts
        elif isinstance(event, Compiled):
            self._print(Text(f"decode step compiled in {event.seconds:.1f} s", style="dim"))

    # ---- what the live area shows -----------------------------------------------------------

    def __rich__(self) -> RenderableType:
        parts: list[RenderableType] = []
        if self.show_text and self._partial:
            parts.append(safe_text(self._visible_partial()))
        if self._evictions.count:
            parts.append(self._eviction_line())
        if self._reading is not None:
            parts.append(Text(reading_line(self._reading), style="dim"))
        if self.stats is not None:
            parts.append(self.status_line(self.stats, self.speed))
        return Group(*parts)

    def status_line(self, stats: CacheStats, speed: float = 0.0) -> Text:
        bar_width, figures = fit_status(stats, speed, self.console.width)
        line = Text()
        for segment, cells in bar_segments(stats, bar_width):
            line.append(BAR_CHARACTERS[segment] * cells, style=SEGMENT_STYLES[segment])
        line.append("  " + " · ".join(figures), style="dim")
        return line

    def _eviction_line(self) -> Text:
        """While a reply streams: the latest forgotten text, as it goes."""
        evictions = self._evictions
        preview = last_words(" ".join(evictions.tail.split()), max(16, self.console.width - 30))
        return Text.assemble(*_forgot(evictions.count), safe_text(f"  …{preview}", "dim"))

    # ---- text ---------------------------------------------------------------------------------

    def _add_text(self, text: str) -> None:
        self._reply += text
        if not self.show_text or self.markdown:
            self._partial += text
            return
        self._partial += text
        *done, self._partial = self._partial.split("\n")
        for line in done:
            self._print(safe_text(line))
        # A long paragraph without newlines: print its wrapped lines but the last. Neutralised
        # first, so that a control sequence is never cut in two before it is made harmless.
        width = self.console.width
        if len(self._partial) > 4 * width:
            wrapped = safe_text(self._partial).wrap(self.console, width)
            for wrapped_line in wrapped[:-1]:
                self._print(wrapped_line)
            self._partial = wrapped[-1].plain

    def _visible_partial(self) -> str:
        if not self.markdown:
            return self._partial
        # Markdown is rendered once complete; meanwhile show the tail of the raw text.
        lines = self._partial.split("\n")
        return "\n".join(lines[-max(3, self.console.height - 4) :])

    def _finish_text(self) -> None:
        """Print what the reply has not printed yet (all of it, as Markdown); once per reply."""
        if self.show_text and self.markdown and self._reply.strip():
            self.console.print(Markdown(safe_plain(self._reply)))
        elif self.show_text and not self.markdown and self._partial:
            self.console.print(safe_text(self._partial))
        self._partial = self._reply = ""

    def _turn_summary(self, stats: TurnStats) -> None:
        self._finish_text()
        evictions = self._evictions
        if evictions.count:
            self._print(
                Text.assemble(
                    *_forgot(evictions.count),
                    (f" (#{evictions.first_index:,}–#{evictions.last_index:,})", "dim"),
                    safe_text(f"  {evictions.preview(max(24, self.console.width - 40))}", "dim"),
                )
            )
        self._print(Text(turn_stats_line(stats), style="dim"))
        self._evictions = _TurnEvictions()

    def _print(self, renderable: RenderableType) -> None:
        # Above the live area while it is up; plainly otherwise.
        (self._live.console if self._live is not None else self.console).print(renderable)

    # ---- outside a turn -------------------------------------------------------------------

    def notice(self, text: str) -> None:
        self.console.print(safe_text(text, "dim"))

    def error(self, text: str) -> None:
        self.console.print(Text.assemble(("error:", "bold red"), " ", safe_text(text)))

    def table(self, title: str, rows: Iterable[tuple[str, str]]) -> None:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for key, value in rows:
            table.add_row(safe_text(key), safe_text(value))  # Text: model output is not Rich markup
        self.console.print(Text(title, style="bold underline"))
        self.console.print(table)


def _forgot(count: int) -> tuple[tuple[str, str], ...]:
    return ("⟲ ", "yellow"), (f"forgot {count:,} token{'s' if count != 1 else ''}", "yellow")


def resumed_text(event: Resumed) -> str:
    return f"resumed {event.messages} messages exactly where they stopped ({event.tokens:,} tokens in the cache)"


def prompt_skipped_text(event: PromptSkipped) -> str:
    """What the user is told when only part of a prompt was read."""
    if event.reason == "stopped":
        return (
            f"stopped reading your message after {event.read_tokens:,} of {event.prompt_tokens:,} tokens; "
            "the model saw only that part"
        )
    return (
        f"read the last {event.read_tokens:,} of {event.prompt_tokens:,} prompt tokens; the model could not have "
        "seen the rest; --read-all streams all of it"
    )


def reading_line(progress: PromptProgress) -> str:
    """A long prompt being read: "reading your message: 12,000/250,030 tokens · 640 tok/s · 6 min 12 s left";
    a conversation replayed (/system, /load, --continue): "replaying the conversation: 1,024/4,044 tokens · ..."."""
    what = "replaying the conversation" if progress.reading == "conversation" else "reading your message"
    line = f"{what}: {progress.read_tokens:,}/{progress.total_tokens:,} tokens"
    if progress.tokens_per_second > 0:
        line += f" · {progress.tokens_per_second:,.0f} tok/s"
    if progress.seconds_left is not None:
        minutes, seconds = divmod(round(progress.seconds_left), 60)
        line += f" · {minutes} min {seconds} s left" if minutes else f" · {seconds} s left"
    # A replay cannot stop half way: the cache would hold part of a conversation.
    return line if progress.reading == "conversation" else line + " · Ctrl-C stops"


def turn_stats_line(stats: TurnStats) -> str:
    reason = {
        "eos": "",
        "stop_string": " · stop string",
        "max_new_tokens": " · length limit",
        "interrupted": " · stopped",
    }
    return (
        f"{stats.generated_tokens:,} tokens · {stats.decode_tokens_per_second:.1f} tok/s · "
        f"prompt {stats.prompt_tokens:,} at {stats.prefill_tokens_per_second:.0f} tok/s · "
        f"first token {stats.time_to_first_token:.2f} s{reason[stats.stop_reason]}"
    )


def recalled_text(event: Recalled) -> str:
    """↺ recalled 2 passages from turns 3 and 7 (41 tokens)"""
    passages = "1 passage" if event.passages == 1 else f"{event.passages} passages"
    return f"↺ recalled {passages} from {turns_text(event.turns)} ({event.tokens:,} tokens)"


def turns_text(turns: tuple[int, ...] | list[int]) -> str:
    """turn 3; turns 3 and 7; turns 2, 3 and 7"""
    if len(turns) == 1:
        return f"turn {turns[0]}"
    return "turns " + ", ".join(str(turn) for turn in turns[:-1]) + f" and {turns[-1]}"
