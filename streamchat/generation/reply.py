"""One reply as the session generates it: its tokens, its text cut at a stop string, its timing."""

from __future__ import annotations

import time
from typing import Any

from streamchat.generation.detokenize import IncrementalDetokenizer
from streamchat.generation.events import StopReason, TurnStats
from streamchat.generation.settings import GenerationSettings


class Reply:
    """One reply as it grows: its tokens, its text (cut at a stop string), its timing."""

    def __init__(self, tokenizer: Any, settings: GenerationSettings, started: float, prefilled: float) -> None:
        self.settings = settings
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.ids: list[int] = []
        self.text = ""  # what has been shown
        self._held = ""  # text that may be the start of a stop string
        self.reason: StopReason = "max_new_tokens"
        self.started = started  # when the turn began
        self.prefilled = prefilled  # when its prompt was in the cache
        self.first_token_at: float | None = None

    def add(self, token: int) -> str:
        """Take a sampled token; return the text it shows (none past a stop string, none that may begin one)."""
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.ids.append(token)
        return self._show(self.detokenizer.push(token))

    def flush(self) -> str:
        """The text still held back, at the end of the reply."""
        return "" if self.reason == "stop_string" else self._show(self.detokenizer.flush(), final=True)

    def decode_speed(self) -> float:
        elapsed = time.perf_counter() - (self.first_token_at or self.started)
        return (len(self.ids) - 1) / elapsed if elapsed > 0 else 0.0

    def stats(self, prompt_tokens: int, copied: int = 0) -> TurnStats:
        now = time.perf_counter()
        first = self.first_token_at or now
        return TurnStats(
            prompt_tokens=prompt_tokens,
            generated_tokens=len(self.ids),
            prefill_seconds=self.prefilled - self.started,
            decode_seconds=now - first,
            time_to_first_token=first - self.started,
            stop_reason=self.reason,
            copied_prompt_tokens=copied,
        )

    def _show(self, delta: str, final: bool = False) -> str:
        stops = self.settings.stop
        if not stops:
            self.text += delta
            return delta
        pending = self._held + delta
        hits = [index for stop in stops if (index := pending.find(stop)) != -1]
        if hits:
            self.reason = "stop_string"
            shown, self._held = pending[: min(hits)], ""
        else:
            # Text that may begin a stop string waits until the next tokens settle it: shown text
            # cannot be taken back.
            held = 0 if final else _stop_prefix_length(pending, stops)
            shown, self._held = pending[: len(pending) - held], pending[len(pending) - held :]
        self.text += shown
        return shown


def _stop_prefix_length(text: str, stops: tuple[str, ...]) -> int:
    """The length of the longest end of `text` that is the beginning of a stop string."""
    longest = min(len(text), max(len(stop) for stop in stops) - 1)
    for length in range(longest, 0, -1):
        if any(stop.startswith(text[-length:]) for stop in stops):
            return length
    return 0
