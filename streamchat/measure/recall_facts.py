"""What recall is measured on: the facts and distractors streamchat ships, filler questions, and what a search
over an index of evicted turns costs.

A fact is stated in a conversation ("My sister's name is Ilse."), asked for later, and
answered with its key word; a distractor asks about a fact never stated, with a made-up
answer. Filler turns push the facts out of the window: MT-bench's first-turn questions
when a copy is at hand, else the questions streamchat ships.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from streamchat.conversation.recall import RecallIndex


@dataclass(frozen=True)
class Fact:
    """A statement, the question that asks for it, the answer, and the word a reply must hold."""

    statement: str
    question: str
    answer: str
    key: str


def shipped_facts() -> tuple[list[Fact], list[Fact]]:
    """The facts and distractors streamchat ships (a distractor's key is its made-up answer's)."""
    text = resources.files("streamchat").joinpath("data/recall_facts.json").read_text(encoding="utf-8")
    data = json.loads(text)
    facts = [Fact(**item) for item in data["facts"]]
    distractors = [Fact("", item["question"], item["answer"], item["answer"]) for item in data["distractors"]]
    return facts, distractors


def filler_questions(shared: Path | None = None) -> list[str]:
    """MT-bench's first-turn questions when `shared` (an MT-bench JSONL file) exists, else the shipped ones."""
    if shared is not None and shared.is_file():
        questions: list[str] = []
        for line in shared.read_text(encoding="utf-8").splitlines():
            if line.strip():
                turns = json.loads(line).get("turns") or []
                questions.extend(turns[:1])
        if questions:
            return questions
    text = resources.files("streamchat").joinpath("data/chat_questions.txt").read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def search_costs(
    facts: list[Fact], filler: list[str], replies: list[str], turn_counts: tuple[int, ...], repeats: int
) -> list[tuple[int, float, float]]:
    """(evicted turns, seconds to index them, median seconds of a search) for each of `turn_counts`: each turn a
    filler question and a reply, the facts among the first; each fact's question searched `repeats` times
    (at least 3)."""
    costs = []
    for turns in turn_counts:
        index = RecallIndex()
        started = time.perf_counter()
        for turn in range(turns):
            user = facts[turn].statement if turn < len(facts) else filler[turn % len(filler)]
            index.add(2 * turn, "user", user)
            index.add(2 * turn + 1, "assistant", replies[turn % len(replies)])
        built = time.perf_counter() - started
        timings = []
        for _ in range(max(3, repeats)):
            for fact in facts:
                started = time.perf_counter()
                index.search(fact.question)
                timings.append(time.perf_counter() - started)
        costs.append((turns, built, statistics.median(timings)))
    return costs
