"""The cache status line, as plain data: the occupancy bar's segments and the figures beside it.

Shared by the live Rich panel and the prompt toolbar, which only style it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from streamchat.cache.ledger import CacheStats

Segment = Literal["sinks", "window", "free"]

# Characters that keep the bar readable without colour (NO_COLOR, dumb terminals).
BAR_CHARACTERS: dict[Segment, str] = {"sinks": "▓", "window": "█", "free": "░"}
# Narrower terminals drop the figures first, then shrink the bar down to this.
MIN_BAR_WIDTH = 10
MAX_BAR_WIDTH = 40


def bar_segments(stats: CacheStats, width: int) -> list[tuple[Segment, int]]:
    """Split `width` cells between sinks, used window and free slots, in proportion.

    A non-empty part always gets at least one cell, so the sinks stay visible even
    though they are 4 slots out of 2004.
    """
    parts: list[tuple[Segment, int]] = [
        ("sinks", stats.sinks_held),
        ("window", stats.window_used),
        ("free", stats.capacity - stats.used),
    ]
    cells = {name: round(width * amount / stats.capacity) if stats.capacity else 0 for name, amount in parts}
    for name, amount in parts:
        if amount and not cells[name]:
            cells[name] = 1
    # Give or take the rounding difference from the largest part.
    largest = max(cells, key=lambda name: cells[name])
    cells[largest] += width - sum(cells.values())
    return [(name, cells[name]) for name, _ in parts if cells[name] > 0]


@dataclass(frozen=True)
class StatusFigures:
    """The figures beside the bar, as text, most important first."""

    occupancy: str  # "4 sinks | 1,873/2,000 window | 127 free"
    streamed: str  # "18,342 streamed"
    evicted: str  # "16,465 evicted"
    speed: str  # "17.3 tok/s" ("" when unknown)


def status_figures(stats: CacheStats, tokens_per_second: float = 0.0) -> StatusFigures:
    free = stats.capacity - stats.used
    return StatusFigures(
        occupancy=f"{stats.sinks_held} sinks | {stats.window_used:,}/{stats.window_capacity:,} window | {free:,} free",
        streamed=f"{stats.seen:,} streamed",
        evicted=f"{stats.evicted:,} evicted",
        speed=f"{tokens_per_second:.1f} tok/s" if tokens_per_second > 0 else "",
    )


def fit_status(stats: CacheStats, tokens_per_second: float, columns: int) -> tuple[int, list[str]]:
    """The bar width and the figures that fit in `columns`, dropping figures before shrinking the bar."""
    figures = status_figures(stats, tokens_per_second)
    wanted = [figures.occupancy, figures.streamed, figures.evicted, figures.speed]
    wanted = [text for text in wanted if text]
    while True:
        text_width = sum(len(text) + 3 for text in wanted)
        bar = min(MAX_BAR_WIDTH, columns - text_width - 1)
        if bar >= MIN_BAR_WIDTH or not wanted:
            return max(bar, min(MIN_BAR_WIDTH, columns)), wanted
        wanted.pop()


def first_words(text: str, limit: int) -> str:
    """At most `limit` characters from the start, not ending in a cut word when a space allows."""
    cut = text[:limit]
    if len(text) > limit and text[limit] != " " and " " in cut:
        cut = cut.rsplit(" ", 1)[0]
    return cut.rstrip()


def last_words(text: str, limit: int) -> str:
    """At most `limit` characters from the end, not starting in a cut word when a space allows."""
    return first_words(text[::-1], limit)[::-1]
