"""Does the live display slow generation? The same greedy reply, with and without the Rich display.

Each trial resets the session and answers the same prompt greedily, so both sides
generate the same tokens from the same cache. Trials alternate between the engine
alone (events consumed, nothing drawn) and the app's display rendering every event on
a terminal console (written to /dev/null: drawing costs, the terminal does not), in
alternating order, so machine noise hits both alike. The figure compares the median
decode speed of each.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass
from typing import Any

from rich.console import Console

from streamchat.app.display import ChatDisplay
from streamchat.engine.events import TurnFinished
from streamchat.engine.session import ChatSession, SessionOptions
from streamchat.engine.settings import GenerationSettings

PROMPT = "Tell me a long story about a lighthouse keeper and the sea."
# The live display may cost at most this share of decode speed.
APP_VS_ENGINE_MIN = 0.95


@dataclass(frozen=True)
class DisplayOverhead:
    engine_tokens_per_second: list[float]
    app_tokens_per_second: list[float]

    @property
    def ratio(self) -> float:
        """App over engine decode speed (1.0: the display costs nothing)."""
        return statistics.median(self.app_tokens_per_second) / statistics.median(self.engine_tokens_per_second)


def measure_display_overhead(
    model: Any, tokenizer: Any, *, trials: int, max_new_tokens: int, sinks: int, window: int
) -> DisplayOverhead:
    settings = GenerationSettings(max_new_tokens=max_new_tokens, temperature=0.0)
    session = ChatSession(model, tokenizer, SessionOptions(sinks=sinks, window=window, settings=settings))
    with open(os.devnull, "w", encoding="utf-8") as sink:
        display = ChatDisplay(Console(file=sink, force_terminal=True, width=100, height=40))
        engine, app = [], []
        for trial in range(trials):
            # Who goes first alternates, so warm-up and drift favour neither side.
            sides = [(engine, None), (app, display.show)]
            for speeds, show in sides if trial % 2 == 0 else reversed(sides):
                speeds.append(_decode_speed(session, show))
    return DisplayOverhead(engine, app)


def _decode_speed(session: ChatSession, show: Any) -> float:
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
    return finished[0].stats.decode_tokens_per_second
