"""`streamchat bench recall`: facts stated early, evicted by filler, asked for again, with recall off and on.

A conversation states facts ("My sister's name is Ilse.", streamchat/data/recall_facts.json),
each answered greedily. Right after each fact, while it is in the window, its question is
asked (the ceiling). Filler turns (MT-bench's questions, replies generated once, greedily)
follow until every fact has left the window; then each fact's question is asked from that
same point with recall off and with recall on. Each ask is taken back before the next.

For each question: the mean log-probability per token of the answer, teacher-forced after
the prompt the chat would feed (a recall note included), and whether a greedy reply holds
the fact's key word. Distractors ask about facts never stated, with a made-up answer: recall
must not make that answer likelier. The cost: time to first token at turn `ttft_turns`, recall
off and on, side by side; and the search's time over an index of 10,000 evicted turns.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from streamchat import defaults
from streamchat.bench.options import require_at_least
from streamchat.cache.ledger import SMALLEST_WINDOW
from streamchat.conversation.message import Message
from streamchat.conversation.session import ChatSession
from streamchat.conversation.session_options import SessionOptions
from streamchat.conversation.state import ConversationState, RecalledNote
from streamchat.engine.engine import Engine
from streamchat.errors import ConfigError
from streamchat.generation.driver import Driver
from streamchat.generation.events import Event, TextDelta, TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.measure.perplexity import answer_log_prob
from streamchat.measure.recall_facts import Fact
from streamchat.measure.report import Check, Column, Row

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Targets (issue 24): recall on recovers this share of the log-probability gap between recall off and the
# ceiling, and this share of the ceiling's greedy matches; time to first token at most this much above off.
GAP_RECOVERED_MIN = 0.75
MATCHES_MIN = 0.75
TTFT_OVERHEAD_MAX = 0.15
SEARCH_SECONDS_MAX = 0.010
SEARCH_TURNS_TARGET = 10_000


@dataclass(frozen=True)
class RecallSizes:
    window: int
    reply_tokens: int  # longest filler (and fact) reply
    answer_tokens: int  # longest greedy answer to a question
    facts: int
    distractors: int
    ttft_turns: int  # the turn time to first token is measured at
    search_turns: tuple[int, ...]  # evicted turns the search is timed over
    repeats: int  # timings per side; the median counts

    def __post_init__(self) -> None:
        require_at_least("--window", self.window, SMALLEST_WINDOW)
        require_at_least("--reply-tokens", self.reply_tokens, 1)
        require_at_least("--facts", self.facts, 1)


FULL = RecallSizes(
    window=defaults.RECALL_BENCH_WINDOW,
    reply_tokens=defaults.RECALL_BENCH_REPLY_TOKENS,
    answer_tokens=16,
    facts=defaults.RECALL_BENCH_FACTS,
    distractors=6,
    ttft_turns=defaults.RECALL_BENCH_TURN,
    search_turns=(100, 1_000, SEARCH_TURNS_TARGET),
    repeats=5,
)
QUICK = RecallSizes(
    window=160, reply_tokens=6, answer_tokens=6, facts=2, distractors=1, ttft_turns=8, search_turns=(10, 100), repeats=1
)


@dataclass(frozen=True)
class Asked:
    """One question asked at one point of the conversation."""

    log_prob: float  # mean per answer token, teacher-forced
    matched: bool  # the greedy reply holds the key
    reply: str
    recalled: tuple[int, ...]  # messages the recall note brought back (none: no note)
    relevance: float = 0.0  # the most of the question's word weight any evicted passage holds (the bar's measure)


@dataclass(frozen=True)
class FactResult:
    fact: Fact
    message: int  # the statement's index in the transcript
    ceiling: Asked
    off: Asked
    on: Asked


@dataclass(frozen=True)
class DistractorResult:
    question: str
    off: Asked
    on: Asked


@dataclass(frozen=True)
class Costs:
    turn: int
    ttft_off: float  # median seconds
    ttft_on: float
    search: list[tuple[int, float, float]]  # (evicted turns, index build seconds, median search seconds)


class RecallBench:
    """One conversation through one session: the facts, the filler, the questions."""

    def __init__(self, model: Any, tokenizer: Any, sizes: RecallSizes, on_step: Callable[[str], None]) -> None:
        self.model, self.tokenizer, self.sizes, self.on_step = model, tokenizer, sizes, on_step
        settings = GenerationSettings(max_new_tokens=sizes.reply_tokens, temperature=0.0)
        self.session = ChatSession(
            model, tokenizer, SessionOptions(window=sizes.window, settings=settings, recall="off")
        )
        self.driver = Driver(Engine(model))  # the process's: it runs the session's moves
        self.device = model.get_input_embeddings().weight.device

    def run(
        self, facts: list[Fact], distractors: list[Fact], filler: list[str]
    ) -> tuple[list[FactResult], list[DistractorResult]]:
        stated = self.evict(facts, filler)
        asked = [*facts, *distractors]
        answers = self.ask(asked, ("off", "auto"))
        off, on = answers["off"], answers["auto"]
        self.on_step("facts and distractors asked with recall off and on")
        results = [
            FactResult(fact, message, ceiling, off[number], on[number])
            for number, (fact, message, ceiling) in enumerate(stated)
        ]
        count = len(facts)
        others = [
            DistractorResult(item.question, off[count + number], on[count + number])
            for number, item in enumerate(distractors)
        ]
        return results, others

    def evict(self, facts: list[Fact], filler: list[str]) -> list[tuple[Fact, int, Asked]]:
        """State the facts (each asked for while in the window, the ceiling), then filler until all have left it:
        (fact, its statement's message, the ceiling) for each."""
        session = self.session
        stated: list[tuple[Fact, int, Asked]] = []
        for number, fact in enumerate(facts, start=1):
            message = len(session.transcript)
            _drain(self.driver.run(session.chat(fact.statement)))
            stated.append((fact, message, self.ask([fact], ("off",))["off"][0]))
            self.on_step(f"fact {number}/{len(facts)} stated and asked while in the window")
        last_fact = stated[-1][1]
        turns = 0
        while session.cache_view().forgotten_messages <= last_fact + 1:
            if turns >= 20 * len(filler):
                raise ConfigError("the facts never left the window: lower --window")
            _drain(self.driver.run(session.chat(filler[turns % len(filler)])))
            turns += 1
            self.on_step(f"filler turn {turns}: {session.cache_view().forgotten_messages} messages evicted")
        return stated

    def ask(self, facts: list[Fact], modes: tuple[str, ...], greedy: bool = True) -> dict[str, list[Asked]]:
        """Ask each of `facts`' questions now with each recall mode of `modes`, each taken back before the next
        (`greedy` False: the teacher-forced probes only, no reply; `matched` is then False).

        Every teacher-forced probe reads the cache as it stands (each is taken back slot for slot) before any
        greedy reply is asked for: a cache restored after a reply is not bit for bit the one before it.
        """
        session = self.session
        chat_format = session.chat_format
        probes: dict[str, list[tuple[float, RecalledNote | None]]] = {}
        relevance = [
            max((found.relevance for found in session.recall_search(fact.question, 0.0)), default=0.0) for fact in facts
        ]
        for mode in modes:
            session.recall = mode
            probes[mode] = []
            for fact in facts:
                prompt, note = session.next_prompt(fact.question)
                answer = chat_format.reply_ids(fact.answer)[: -len(chat_format.end_of_turn_ids) or None]
                probes[mode].append((answer_log_prob(self.model, session.cache, prompt, answer, self.device), note))
        state = session.snapshot()
        asked: dict[str, list[Asked]] = {}
        for mode in modes:
            session.recall = mode
            asked[mode] = []
            for fact, (log_prob, note), best in zip(facts, probes[mode], relevance, strict=True):
                reply = ""
                if greedy:
                    session.update_settings(max_new_tokens=self.sizes.answer_tokens)
                    reply = _reply(self.driver.run(session.chat(fact.question)))
                    session.update_settings(max_new_tokens=self.sizes.reply_tokens)
                    self._restore(state)
                matched = greedy and fact.key.lower() in reply.lower()
                recalled = note.messages if note is not None else ()
                asked[mode].append(Asked(log_prob, matched, reply, recalled, best))
        session.recall = "off"
        return asked

    def time_to_first_token(self, facts: list[Fact], filler: list[str], replies: list[str]) -> tuple[int, float, float]:
        """At turn `ttft_turns` of a conversation that stated the facts and went on with filler (read as a replay),
        the median time to the first token of the first fact's question, recall off and on, side by side."""
        session = self.session
        messages: list[Message] = []
        for fact in facts:
            messages += [{"role": "user", "content": fact.statement}, {"role": "assistant", "content": "Noted."}]
        index = 0
        while len(messages) < 2 * (self.sizes.ttft_turns - 1):
            text = filler[index % len(filler)]
            messages += [
                {"role": "user", "content": text},
                {"role": "assistant", "content": replies[index % len(replies)]},
            ]
            index += 1
        _drain(self.driver.run(session.replay(messages)))
        session.update_settings(max_new_tokens=2)  # the first token is what is timed
        state = session.snapshot()
        sides: dict[str, list[float]] = {"off": [], "auto": []}
        for _ in range(self.sizes.repeats):
            for recall in sides:
                session.recall = recall
                finished = _finished(self.driver.run(session.chat(facts[0].question)))
                sides[recall].append(finished.stats.time_to_first_token)
                self._restore(state)
        session.recall = "off"
        return len(messages) // 2 + 1, statistics.median(sides["off"]), statistics.median(sides["auto"])

    def _restore(self, state: ConversationState) -> None:
        _drain(self.driver.run(self.session.restore(state)))


def _drain(events: Iterator[Event]) -> None:
    for _ in events:
        pass


def _finished(events: Iterator[Event]) -> TurnFinished:
    finished = None
    for event in events:
        if isinstance(event, TurnFinished):
            finished = event
    if finished is None:
        raise ConfigError("a reply ended without finishing")
    return finished


def _reply(events: Iterator[Event]) -> str:
    return "".join(event.text for event in events if isinstance(event, TextDelta))


# ---- what the runs show ---------------------------------------------------------------------


def gap_recovered(results: list[FactResult]) -> float:
    """(mean on - mean off) / (mean ceiling - mean off): the share of what eviction lost that recall gives back."""
    off = statistics.fmean(result.off.log_prob for result in results)
    on = statistics.fmean(result.on.log_prob for result in results)
    ceiling = statistics.fmean(result.ceiling.log_prob for result in results)
    return (on - off) / (ceiling - off) if ceiling != off else 0.0


def columns() -> list[Column]:
    return [
        Column("question", "question"),
        Column("off", "log-prob off", "{:.3f}"),
        Column("on", "on", "{:.3f}"),
        Column("ceiling", "in window", "{:.3f}"),
        Column("match_off", "greedy off"),
        Column("match_on", "on"),
        Column("match_ceiling", "in window"),
        Column("recalled", "recalled turns"),
        Column("relevance", "best share", "{:.2f}"),
    ]


def rows(results: list[FactResult], distractors: list[DistractorResult]) -> list[Row]:
    def mark(asked: Asked) -> str:
        return "yes" if asked.matched else "no"

    def turns(asked: Asked) -> str:
        return " ".join(str(message // 2 + 1) for message in asked.recalled) or "-"

    table: list[Row] = [
        {
            "question": result.fact.question,
            "off": result.off.log_prob,
            "on": result.on.log_prob,
            "ceiling": result.ceiling.log_prob,
            "match_off": mark(result.off),
            "match_on": mark(result.on),
            "match_ceiling": mark(result.ceiling),
            "recalled": turns(result.on),
            "relevance": result.on.relevance,
        }
        for result in results
    ]
    table.append(
        {
            "question": "mean over the facts",
            "off": statistics.fmean(result.off.log_prob for result in results),
            "on": statistics.fmean(result.on.log_prob for result in results),
            "ceiling": statistics.fmean(result.ceiling.log_prob for result in results),
            "match_off": f"{sum(result.off.matched for result in results)}/{len(results)}",
            "match_on": f"{sum(result.on.matched for result in results)}/{len(results)}",
            "match_ceiling": f"{sum(result.ceiling.matched for result in results)}/{len(results)}",
            "recalled": f"{sum(bool(result.on.recalled) for result in results)} notes",
            "relevance": None,
        }
    )
    for item in distractors:
        table.append(
            {
                "question": f"distractor: {item.question}",
                "off": item.off.log_prob,
                "on": item.on.log_prob,
                "ceiling": None,
                "match_off": "-",
                "match_on": "-",
                "match_ceiling": "-",
                "recalled": turns(item.on),
                "relevance": item.on.relevance,
            }
        )
    return table


def cost_columns() -> list[Column]:
    return [
        Column("measure", "cost"),
        Column("turns", "turns", "{:,}"),
        Column("off", "recall off", "{:.4f}"),
        Column("on", "recall on", "{:.4f}"),
    ]


def cost_rows(costs: Costs) -> list[Row]:
    table: list[Row] = [
        {"measure": "time to first token, s", "turns": costs.turn, "off": costs.ttft_off, "on": costs.ttft_on}
    ]
    for turns, built, search in costs.search:
        table.append({"measure": "index build s / search s", "turns": turns, "off": built, "on": search})
    return table


def checks(results: list[FactResult], distractors: list[DistractorResult], costs: Costs) -> list[Check]:
    ceiling_matches = sum(result.ceiling.matched for result in results)
    on_matches = sum(result.on.matched for result in results)
    found = [Check("share of the log-prob gap recall recovers", gap_recovered(results), GAP_RECOVERED_MIN, False)]
    found.append(
        Check(
            "greedy matches on / in window",
            on_matches / ceiling_matches if ceiling_matches else 0.0,
            MATCHES_MIN,
            False,
        )
    )
    if distractors:
        worst = max(item.on.log_prob - item.off.log_prob for item in distractors)
        found.append(Check("distractors: largest log-prob rise with recall on", worst, 0.0, True))
    overhead = costs.ttft_on / costs.ttft_off - 1 if costs.ttft_off > 0 else 0.0
    found.append(Check(f"time to first token at turn {costs.turn}, on over off - 1", overhead, TTFT_OVERHEAD_MAX, True))
    turns, _, search = costs.search[-1]
    found.append(Check(f"search seconds over {turns:,} evicted turns", search, SEARCH_SECONDS_MAX, True))
    return found


def draw(results: list[FactResult], costs: Costs) -> Callable[[Figure], None]:
    def drawing(figure: Figure) -> None:
        left, right = figure.subplots(1, 2)
        positions = range(len(results))
        for offset, (label, values) in enumerate(
            (
                ("recall off", [result.off.log_prob for result in results]),
                ("recall on", [result.on.log_prob for result in results]),
                ("in window", [result.ceiling.log_prob for result in results]),
            )
        ):
            left.bar([position + (offset - 1) * 0.27 for position in positions], values, width=0.27, label=label)
        left.set_xticks(list(positions), [result.fact.key for result in results], rotation=45, ha="right")
        left.set_ylabel("answer log-probability per token")
        left.set_title("facts asked after they left the window")
        left.legend()
        left.grid(True, axis="y", alpha=0.3)
        turns = [turns for turns, _, _ in costs.search]
        right.plot(turns, [search * 1000 for _, _, search in costs.search], marker="o")
        right.set_xscale("log")
        right.set_xlabel("evicted turns indexed")
        right.set_ylabel("search, ms (median)")
        right.set_title("search time")
        right.grid(True, alpha=0.3)

    return drawing
