#!/usr/bin/env python3
"""What `streamchat bench recall` recalls, without its 43 minutes: the bench's own conversation, then its search.

    PYTHONPATH=$PWD python scripts/recall_search_check.py
    PYTHONPATH=$PWD python scripts/recall_search_check.py --window 256 --bar 0.5

The bench's conversation on the default model (its sizes, its facts, its filler) is run up to the
point where every fact has left the window: each fact stated and asked while in the window, filler
replies generated greedily, exactly as the bench does. Then, for every fact question and every
distractor, it prints each evicted passage that shares a word with the question, with the share of
the question's word weight it holds (the relevance the bar is on), marks the passages the note
brings back, and teacher-forces the answer with recall off and on, as the bench does (no greedy
replies, no timings). A question that recalls nothing feeds exactly what recall off feeds, so its
two log-probabilities are equal to the last digit.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from streamchat import defaults
from streamchat.bench import recall as bench
from streamchat.interface.config import load_options, load_run_config
from streamchat.loading import load_model
from streamchat.measure.recall_facts import filler_questions, shipped_facts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=bench.FULL.window)
    parser.add_argument("--bar", type=float, default=defaults.RECALL_MIN_RELEVANCE, help="the relevance bar to show")
    arguments = parser.parse_args()

    loaded = load_model(load_options(load_run_config({})))
    sizes = bench.RecallSizes(**{**bench.FULL.__dict__, "window": arguments.window})
    facts, distractors = shipped_facts()
    run = bench.RecallBench(loaded.model, loaded.tokenizer, sizes, on_step=lambda step: print(step, file=sys.stderr))
    run.evict(facts[: sizes.facts], filler_questions())
    session = run.session
    evicted = session.cache_view().forgotten_messages
    print(f"{loaded.source.name}, window {sizes.window}: {len(session.transcript)} messages, {evicted} evicted")
    print(f"relevance bar {arguments.bar} (a passage must hold this share of the question's word weight)\n")

    asked = [*facts[: sizes.facts], *distractors]
    answers = run.ask(asked, ("off", "auto"), greedy=False)
    for number, item in enumerate(asked):
        kind = "fact" if number < sizes.facts else "distractor"
        off, on = answers["off"][number], answers["auto"][number]
        same = "equal" if off.log_prob == on.log_prob else "differ"
        print(f"{kind}: {item.question}")
        print(
            f"  log-prob off {off.log_prob:.3f}, on {on.log_prob:.3f} ({same}); note from messages {list(on.recalled)}"
        )
        for passage in session.recall_search(item.question, 0.0):
            mark = (
                "RECALLED"
                if passage.message in on.recalled
                else ("clears" if passage.relevance >= arguments.bar else "-")
            )
            print(
                f"  {passage.relevance:.2f} {mark:8} t{passage.message // 2 + 1} {passage.role}: {passage.text[:60]!r}"
            )
    fact_low = min(answers["auto"][number].relevance for number in range(sizes.facts))
    distractor_high = max(answers["auto"][number].relevance for number in range(sizes.facts, len(asked)))
    print(f"\nfacts: the best passage holds at least {fact_low:.2f}; distractors: at most {distractor_high:.2f}")


if __name__ == "__main__":
    main()
