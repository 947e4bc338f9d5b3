"""Does the live display slow generation? The same greedy reply, with and without the Rich display.

Each trial resets the session and answers the same prompt greedily, so both sides
generate the same tokens from the same cache. Trials alternate between the engine
alone (events consumed, nothing drawn) and the app's display rendering every event on
a terminal console (written to /dev/null: drawing costs, the terminal does not), in
alternating order, so machine noise hits both alike. The figure compares the median
decode speed of each; the replies are kept, to show that both sides said the same.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.cache.ledger import SMALLEST_WINDOW
from streamchat.conversation.driven import DrivenSession, driven_session
from streamchat.conversation.session_options import SessionOptions
from streamchat.generation.events import TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.display import ChatDisplay
from streamchat.measure.report import Check, Column, Row

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
# The live display may cost at most this share of decode speed.
APP_VS_ENGINE_MIN = 0.95


@dataclass(frozen=True)
class DisplaySizes:
    trials: int  # replies per side
    max_new_tokens: int  # tokens per reply
    window: int
    sinks: int = defaults.SINKS

    def __post_init__(self) -> None:
        require_at_least("--trials", self.trials, 1)
        # Decode speed needs a second token: the first comes from the prefill.
        require_at_least("--max-new-tokens", self.max_new_tokens, 2)
        require_at_least("--window", self.window, SMALLEST_WINDOW)
        require_at_least("--sinks", self.sinks, 0)


@dataclass(frozen=True)
class DisplayOverhead:
    """Per trial, each side's decode speed and reply, in the order the trials ran."""

    engine_tokens_per_second: list[float]
    app_tokens_per_second: list[float]
    engine_replies: list[str]
    app_replies: list[str]

    @property
    def ratio(self) -> float:
        """App over engine decode speed (1.0: the display costs nothing)."""
        return statistics.median(self.app_tokens_per_second) / statistics.median(self.engine_tokens_per_second)


def measure_display_overhead(model: Any, tokenizer: Any, sizes: DisplaySizes) -> DisplayOverhead:
    """Answer the prompt `sizes.trials` times per side, greedily, from a fresh session each time."""
    settings = GenerationSettings(max_new_tokens=sizes.max_new_tokens, temperature=0.0)
    session = driven_session(model, tokenizer, SessionOptions(keep=sizes.sinks, window=sizes.window, settings=settings))
    with open(os.devnull, "w", encoding="utf-8") as sink:
        display = ChatDisplay(Console(file=sink, force_terminal=True, width=100, height=40))
        engine: list[TurnFinished] = []
        app: list[TurnFinished] = []
        for trial in range(sizes.trials):
            # Who goes first alternates, so warm-up and drift favour neither side.
            sides = [(engine, None), (app, display.show)]
            for finished, show in sides if trial % 2 == 0 else reversed(sides):
                finished.append(_reply(session, show))
    return DisplayOverhead(
        [turn.stats.decode_tokens_per_second for turn in engine],
        [turn.stats.decode_tokens_per_second for turn in app],
        [turn.reply for turn in engine],
        [turn.reply for turn in app],
    )


def _reply(session: DrivenSession, show: Any) -> TurnFinished:
    """Answer the prompt from a fresh session, through `show` (the display) or with no display (None)."""
    session.reset()
    finished: list[TurnFinished] = []

    def events() -> Any:
        for event in session.chat(PROMPT):
            if isinstance(event, TurnFinished):
                finished.append(event)
            yield event

    if show is None:
        for _ in events():
            pass
    else:
        show(events())
    return finished[0]


# ---- what the trials show ------------------------------------------------------------------


def columns() -> list[Column]:
    return [
        Column("trial", "trial"),
        Column("engine", "engine tok/s", "{:.2f}"),
        Column("app", "app tok/s", "{:.2f}"),
    ]


def rows(result: DisplayOverhead) -> list[Row]:
    speeds = zip(result.engine_tokens_per_second, result.app_tokens_per_second, strict=True)
    return [{"trial": index + 1, "engine": engine, "app": app} for index, (engine, app) in enumerate(speeds)]


def checks(result: DisplayOverhead) -> list[Check]:
    return [Check("app / engine decode speed (medians)", result.ratio, APP_VS_ENGINE_MIN, at_most=False)]
