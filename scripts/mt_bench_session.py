#!/usr/bin/env python3
"""MT-bench questions as one long chat on the default model, with every eviction shown where it happens.

    .venv/bin/python scripts/mt_bench_session.py ../shared/data/mt_bench.jsonl [TURNS]

Greedy, 128 new tokens per reply, the default 4 + 2000 cache. Each reply streams with
⟦evicted N #first-#last 'text'⟧ marks at the point the cache forgot those tokens, then a
line of the turn's stats and the cache's occupancy.
"""

from __future__ import annotations

import json
import sys
import time

from streamchat.conversation.driven import driven_session
from streamchat.conversation.session_options import SessionOptions
from streamchat.generation.events import Evicted, TextDelta, TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.loading import LoadOptions, load_model


def main(questions: str, turns: int) -> None:
    loaded = load_model(LoadOptions())
    settings = GenerationSettings(max_new_tokens=128, temperature=0.0)
    session = driven_session(loaded.model, loaded.tokenizer, SessionOptions(settings=settings))
    with open(questions, encoding="utf-8") as file:
        prompts = [turn for line in file for turn in json.loads(line)["turns"]][:turns]
    started = time.perf_counter()
    for number, prompt in enumerate(prompts, 1):
        print(f"\n### turn {number}\nUSER: {prompt}\nASSISTANT: ", end="")
        for event in session.chat(prompt):
            if isinstance(event, TextDelta):
                print(event.text, end="")
            elif isinstance(event, Evicted):
                preview = " ".join(event.text.split())[:40]
                print(f"⟦evicted {event.count} #{event.first_index}-{event.last_index} {preview!r}⟧", end="")
            elif isinstance(event, TurnFinished):
                stats, cache = event.stats, session.cache_stats()
                print(
                    f"\n[{stats.generated_tokens} tok, {stats.decode_tokens_per_second:.1f} tok/s, "
                    f"stop={stats.stop_reason}; cache {cache.sinks_held}+{cache.window_used}/{cache.window_capacity}, "
                    f"seen {cache.seen}, evicted {cache.evicted}]"
                )
        sys.stdout.flush()
    print(f"\n{len(prompts)} turns in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) == 3 else 50)
