"""`streamchat bench keep`: after a long chat, does the model still see its instructions?

A system prompt holds a fact ("The secret word is pineapple."). A conversation (the
user turns of a transcript, MT-bench's questions for one) streams through a small
window, far past the point where the system turn leaves it. After the first turn and
after every later one, the question "What is the secret word?" and the answer "The
secret word is pineapple." are teacher-forced: the answer's mean log-probability per
token says how well the model still knows what its system prompt told it. Each probe
is taken back before the conversation goes on (a CacheSnapshot, as /regen does).

Two caches read the conversation: --keep system, whose sinks are the whole system
turn, and --keep 4, the paper's four first tokens. Both read the very same tokens:
the replies are generated once, greedily, through a --keep system cache, and each
cache is then fed the turns as the chat feeds them (ChatFormat), so the caches differ
in what they keep and in nothing else.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.cache import SinkCache
from streamchat.cache.ledger import SMALLEST_WINDOW
from streamchat.conversation.driven import driven_session
from streamchat.conversation.kept_prefix import Keep, kept_tokens
from streamchat.conversation.message import Message
from streamchat.conversation.session_options import SessionOptions
from streamchat.conversation.template import ChatFormat
from streamchat.errors import ConfigError
from streamchat.generation.events import TurnFinished
from streamchat.generation.requests import read_prompt
from streamchat.generation.settings import GenerationSettings
from streamchat.measure.perplexity import answer_log_prob
from streamchat.measure.report import Check, Column, Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

SYSTEM_PROMPT = "You are a helpful assistant. The secret word is pineapple."
QUESTION = "What is the secret word?"
ANSWER = "The secret word is pineapple."
POLICIES: tuple[Keep, ...] = (defaults.KEEP_SYSTEM, defaults.SINKS)
# After the last turn, --keep system's answer must be likelier than --keep 4's by this much per token:
# ln 2, the answer's tokens at least twice as likely on average.
SYSTEM_OVER_FOUR_MIN = math.log(2)


@dataclass(frozen=True)
class KeepSizes:
    turns: int  # user turns streamed
    window: int
    reply_tokens: int  # longest generated reply

    def __post_init__(self) -> None:
        require_at_least("--turns", self.turns, 1)
        require_at_least("--window", self.window, SMALLEST_WINDOW)
        require_at_least("--reply-tokens", self.reply_tokens, 1)


FULL = KeepSizes(
    turns=defaults.KEEP_BENCH_TURNS, window=defaults.KEEP_BENCH_WINDOW, reply_tokens=defaults.KEEP_BENCH_REPLY_TOKENS
)
QUICK = KeepSizes(turns=3, window=64, reply_tokens=12)


@dataclass(frozen=True)
class KeepRun:
    """One cache's reading of the conversation: the answer's mean log-probability after each turn."""

    keep: Keep
    kept: int  # tokens kept as sinks
    window: int
    log_probs: list[float]  # [turn 1, turn 2, ...]
    evicted: int  # window tokens evicted by the end
    seconds: float


def user_turns(texts: Iterator[str], count: int) -> list[str]:
    """The first `count` user turns; ConfigError when the transcript holds fewer."""
    turns = [text for _, text in zip(range(count), texts, strict=False)]
    if len(turns) < count:
        raise ConfigError(f"the transcript holds {len(turns)} user turns, fewer than --turns {count}; lower --turns")
    return turns


def generate_conversation(
    model: Any, tokenizer: Any, turns: list[str], sizes: KeepSizes, on_turn: Callable[[int], None]
) -> list[Message]:
    """The conversation both caches read: each turn answered greedily through a --keep system cache."""
    settings = GenerationSettings(max_new_tokens=sizes.reply_tokens, temperature=0.0)
    options = SessionOptions(window=sizes.window, settings=settings, system_prompt=SYSTEM_PROMPT, recall="off")
    session = driven_session(model, tokenizer, options)
    for number, text in enumerate(turns, start=1):
        for event in session.chat(text):
            if isinstance(event, TurnFinished):
                on_turn(number)
    return session.transcript


def read_with(model: Any, tokenizer: Any, conversation: list[Message], keep: Keep, window: int) -> KeepRun:
    """Stream `conversation` through a cache that keeps `keep`; probe for the secret after every turn."""
    started = time.perf_counter()
    chat_format = ChatFormat(tokenizer, system_prompt=SYSTEM_PROMPT)
    cache = SinkCache.for_model(model, kept_tokens(chat_format, keep, window), window)
    question = chat_format.prompt_ids(QUESTION, first_turn=False)
    answer = chat_format.reply_ids(ANSWER)[: -len(chat_format.end_of_turn_ids) or None]
    device = model.get_input_embeddings().weight.device
    log_probs = []
    for index in range(0, len(conversation), 2):
        user, reply = conversation[index], conversation[index + 1]
        read_prompt(model, cache, chat_format.prompt_ids(user["content"], first_turn=index == 0))
        read_prompt(model, cache, chat_format.reply_ids(reply["content"]))
        log_probs.append(answer_log_prob(model, cache, question, answer, device))
    evicted = cache.stats().evicted
    return KeepRun(keep, cache.sinks, window, log_probs, evicted, time.perf_counter() - started)


# ---- what the runs show ---------------------------------------------------------------------


def columns(sizes: KeepSizes) -> list[Column]:
    return [
        Column("keep", "--keep"),
        Column("cache", "cache"),
        Column("first", "answer log-prob, turn 1", "{:.3f}"),
        Column("last", f"turn {sizes.turns}", "{:.3f}"),
        Column("change", "change", "{:+.3f}"),
        Column("evicted", "evicted", "{:,}"),
        Column("seconds", "wall s", "{:.1f}"),
    ]


def rows(runs: list[KeepRun]) -> list[Row]:
    return [
        {
            "keep": str(run.keep),
            "cache": f"{run.kept}+{run.window}",
            "first": run.log_probs[0],
            "last": run.log_probs[-1],
            "change": run.log_probs[-1] - run.log_probs[0],
            "evicted": run.evicted,
            "seconds": run.seconds,
        }
        for run in runs
    ]


def curve_columns() -> list[str]:
    return ["turn", *(f"keep_{policy}" for policy in POLICIES)]


def curve_rows(runs: list[KeepRun]) -> list[Row]:
    """The answer's log-probability after every turn, one column per cache."""
    return [
        {"turn": turn, **{f"keep_{run.keep}": run.log_probs[turn - 1] for run in runs}}
        for turn in range(1, len(runs[0].log_probs) + 1)
    ]


def checks(runs: list[KeepRun]) -> list[Check]:
    by_keep = {run.keep: run for run in runs}
    system, four = by_keep[defaults.KEEP_SYSTEM], by_keep[defaults.SINKS]
    difference = system.log_probs[-1] - four.log_probs[-1]
    return [Check("keep system - keep 4, answer log-prob after the last turn", difference, SYSTEM_OVER_FOUR_MIN, False)]


def draw_curves(runs: list[KeepRun]) -> Callable[[Figure], None]:
    def draw(figure: Figure) -> None:
        axes = figure.subplots()
        for run in runs:
            turns = range(1, len(run.log_probs) + 1)
            axes.plot(turns, run.log_probs, marker=".", label=f"--keep {run.keep} ({run.kept}+{run.window})")
        axes.set_xlabel("turns streamed")
        axes.set_ylabel("answer log-probability per token")
        axes.set_title(f"{QUESTION!r} → {ANSWER!r}")
        axes.grid(True, alpha=0.3)
        axes.legend()

    return draw
