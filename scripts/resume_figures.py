#!/usr/bin/env python3
"""Exact resume against replay on the default model at a full cache: the state's size, and each one's time.

    .venv/bin/python scripts/resume_figures.py ../shared/data/mt_bench.jsonl
    .venv/bin/python scripts/resume_figures.py TRANSCRIPT --keep 4 --window 2000 --repeats 3

A conversation (the transcript's user turns, sampled replies of up to 48 tokens) fills a
--keep 4 + 2000-token cache and goes on past it; its journal and cache state are written
as streamchat writes them. Then, with the model already loaded (the part of a start that
is the same either way), a fresh session goes on with it twice: resumed from the state,
and replayed (what /load did before). Both load the same journal; the times are each the
fastest of --repeats, side by side in one run. Last, the resumed session's next reply is
compared with the one the uninterrupted session gives.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from streamchat.conversation.driven import driven_session
from streamchat.conversation.session_options import SessionOptions
from streamchat.generation.events import Replayed, Resumed, TurnFinished
from streamchat.generation.settings import GenerationSettings
from streamchat.interface.transcript import UserTurn, read_transcript_file
from streamchat.loading import LoadOptions, load_model
from streamchat.sessions.keeping import save_state, state_key, state_to_restore
from streamchat.storage.journal import Journal
from streamchat.storage.session_file import read_session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("transcript")
    parser.add_argument("--keep", default="4")
    parser.add_argument("--window", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    arguments = parser.parse_args()
    keep = arguments.keep if arguments.keep == "system" else int(arguments.keep)

    loaded = load_model(LoadOptions())
    settings = GenerationSettings(max_new_tokens=48, temperature=0.7, top_p=0.9, seed=1)
    options = SessionOptions(keep=keep, window=arguments.window, settings=settings)

    from streamchat.interface.config import RunConfig

    key = state_key(RunConfig(keep=keep, window=arguments.window), loaded)
    items = read_transcript_file(arguments.transcript, transcript_format="auto", turns="line")
    turns = (item.text for item in items if isinstance(item, UserTurn))
    directory = Path(tempfile.mkdtemp(prefix="resume-figures-"))
    journal = Journal(directory, loaded.source.name, {"keep": keep, "window": arguments.window}, print)
    session = driven_session(loaded.model, loaded.tokenizer, options)
    started = time.perf_counter()
    while session.cache_stats().seen < session.session.cache.capacity + 200:
        text = next(turns)
        journal.record_user(session.snapshot(tensors=False), text)
        for _ in session.chat(text):
            pass
        journal.record(session.snapshot(tensors=False))
    stats = session.cache_stats()
    print(
        f"conversation: {len(session.transcript)} messages, {stats.seen:,} tokens streamed, {stats.evicted:,} evicted, "
        f"cache {stats.used:,}/{stats.capacity:,} ({time.perf_counter() - started:.0f} s)"
    )

    started = time.perf_counter()
    size = save_state(session, journal.path, key)
    print(f"state: {size / 2**20:.1f} MiB on disk ({size:,} bytes), written in {time.perf_counter() - started:.2f} s")

    saved = read_session(journal.path)
    resumed_times, replayed_times = [], []
    for _ in range(arguments.repeats):
        for kind, times in (("resume", resumed_times), ("replay", replayed_times)):
            fresh = driven_session(loaded.model, loaded.tokenizer, options)
            started = time.perf_counter()
            events = list(
                fresh.restore(*state_to_restore(saved, journal.path, key if kind == "resume" else None, fresh.settings))
            )
            times.append(time.perf_counter() - started)
            expected = Resumed if kind == "resume" else Replayed
            if not isinstance(events[-1], expected):
                sys.exit(f"{kind}: ended with {events[-1]!r}")
    threads = torch.get_num_threads()
    resume, replay = min(resumed_times), min(replayed_times)
    print(
        f"resume: {resume:.3f} s   replay: {replay:.3f} s   ({replay / resume:.0f}x; best of {arguments.repeats}, "
        f"{threads} thread{'s' if threads > 1 else ''}, model load not counted)"
    )

    following = "Summarise our conversation in one sentence."
    resumed = driven_session(loaded.model, loaded.tokenizer, options)
    list(resumed.restore(*state_to_restore(saved, journal.path, key, resumed.settings)))
    theirs = [e for e in session.chat(following) if isinstance(e, TurnFinished)][-1].reply
    ours = [e for e in resumed.chat(following) if isinstance(e, TurnFinished)][-1].reply
    print(f"next sampled reply identical to the uninterrupted session's: {ours == theirs}")


if __name__ == "__main__":
    main()
