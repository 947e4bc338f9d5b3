"""Long prompts: read as replays read a conversation, or every token with progress; a stop() between passes."""

import pytest
import torch

from streamchat import defaults
from streamchat.cache import SinkCache, forward
from streamchat.engine.runner import Runner
from streamchat.engine.scheduler import Scheduled
from streamchat.engine.work import Fed
from streamchat.errors import ConfigError
from streamchat.generation.events import (
    CacheOccupancy,
    PromptProgress,
    PromptSkipped,
    PromptTruncated,
    TextDelta,
    TurnFinished,
)
from streamchat.generation.prompt_reading import (
    REPLAYED_WINDOWS,
    Reading,
    ReadingProgress,
    prompt_parts,
    read_prompt,
    replayed_count,
    replayed_parts,
)
from tests.conversation.test_session import make_session, run
from tests.support.models import VOCAB, tiny_model

IDS = list(range(100))


def test_a_prompt_that_fits_two_windows_is_read_whole():
    assert prompt_parts(IDS, seen=0, sinks=4, window=48, read_all=False) == (IDS, [])
    assert prompt_parts(IDS, seen=500, sinks=4, window=50, read_all=False) == ([], IDS)


def test_a_longer_prompt_reads_the_sinks_still_to_fill_and_its_last_two_windows():
    assert prompt_parts(IDS, seen=0, sinks=4, window=20, read_all=False) == (IDS[:4], IDS[-40:])
    assert prompt_parts(IDS, seen=2, sinks=4, window=20, read_all=False) == (IDS[:2], IDS[-40:])
    assert prompt_parts(IDS, seen=500, sinks=4, window=20, read_all=False) == ([], IDS[-40:])
    assert prompt_parts(IDS, seen=500, sinks=4, window=20, read_all=True) == (IDS, [])


def test_replayed_parts_split_a_conversation_message_by_message():
    # Three messages of 10 tokens; skip stream positions 4..18 of 30 (sinks 4, two windows of 6).
    parts = [replayed_parts(list(range(start, start + 10)), start, 4, 18) for start in (0, 10, 20)]
    assert parts == [([0, 1, 2, 3], []), ([], [18, 19]), ([], list(range(20, 30)))]


@pytest.mark.parametrize(("total", "read"), [(0, 0), (15, 15), (16, 16), (22, 16), (1_000, 16)])
def test_replayed_count_is_what_replayed_parts_read_over_a_conversation(total: int, read: int):
    sizes = [10] * (total // 10) + ([total % 10] if total % 10 else [])
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    parts = [
        replayed_parts(list(range(start, start + size)), start, 4, total - REPLAYED_WINDOWS * 6)
        for start, size in zip(starts, sizes, strict=True)
    ]
    assert replayed_count(total, sinks=4, window=6) == read == sum(len(head) + len(tail) for head, tail in parts)


def test_a_replay_shows_its_progress_and_the_cache_filling_from_empty():
    session = make_session(keep=4, window=40)
    for turn in range(6):
        run(session.chat(f"Turn {turn}: tell me something."))
    events = run(session.replay(list(session.transcript)))
    assert isinstance(events[0], CacheOccupancy) and events[0].stats.seen == 0  # not the bar of the cache replaced
    assert events[1] == PromptProgress(0, 84, 0.0, "conversation")
    progress = [(index, event) for index, event in enumerate(events) if isinstance(event, PromptProgress)]
    read = [event.read_tokens for _, event in progress]
    assert read == sorted(set(read)) and read[-1] == 84 == events[-1].tokens
    assert {(event.total_tokens, event.reading) for _, event in progress} == {(84, "conversation")}
    for index, event in progress[1:]:  # after each forward pass, the cache as it fills
        assert events[index + 1] == CacheOccupancy(events[index + 1].stats, 0.0)
        assert events[index + 1].stats.used == min(event.read_tokens, 4 + 40)


def long_prompt(words=150):
    return " ".join(f"word{n % 7}" for n in range(words))


def test_a_prompt_longer_than_the_cache_is_read_from_its_tail_with_a_notice():
    session = make_session(window=40)
    prompt = session.chat_format.prompt_ids(long_prompt(), first_turn=True)
    events = run(session.chat(long_prompt()))
    skipped = [event for event in events if isinstance(event, PromptSkipped)]
    assert skipped == [PromptSkipped(len(prompt), 4 + REPLAYED_WINDOWS * 40, "too_long")]
    truncated = next(event for event in events if isinstance(event, PromptTruncated))
    assert (truncated.prompt_tokens, truncated.visible_tokens) == (len(prompt), 4 + 40)  # sinks and window
    # Read in passes of one window: the sinks, then the two windows.
    assert [event.read_tokens for event in events if isinstance(event, PromptProgress)] == [4, 44, 84]
    finished = events[-1]
    assert finished.stats.prompt_tokens == 84 and finished.stats.generated_tokens == 8
    # What the model sees: the prompt's first 4 tokens as sinks, then the end of the prompt and the reply.
    seen = session.cache_view().token_ids
    assert seen[:4] == prompt[:4]
    assert session.cache_view().forgotten_tokens == len(prompt) + 8 + len(session.chat_format.end_of_turn_ids) - 44
    assert run(session.chat("And now?"))[-1].stats.generated_tokens == 8


def test_read_all_streams_every_token_and_reports_its_progress():
    session = make_session(window=40, read_all=True)
    prompt = session.chat_format.prompt_ids(long_prompt(), first_turn=True)
    events = run(session.chat(long_prompt()))
    assert not [event for event in events if isinstance(event, PromptSkipped)]
    progress = [event for event in events if isinstance(event, PromptProgress)]
    assert [event.read_tokens for event in progress] == [*range(40, len(prompt), 40), len(prompt)]
    assert all(event.total_tokens == len(prompt) and event.tokens_per_second > 0 for event in progress)
    assert progress[-1].seconds_left == 0
    assert events[-1].stats.prompt_tokens == len(prompt)
    assert session.cache_stats().seen == len(prompt) + 8 + len(session.chat_format.end_of_turn_ids)


@pytest.mark.parametrize("read_all", [True, False])
def test_a_stop_while_reading_ends_the_read_between_passes_and_the_next_turn_works(read_all):
    session = make_session(window=40, read_all=read_all)
    prompt = session.chat_format.prompt_ids(long_prompt(300), first_turn=True)
    events = []
    for event in session.chat(long_prompt(300)):
        events.append(event)
        if isinstance(event, PromptProgress) or (isinstance(event, CacheOccupancy) and not read_all):
            session.stop()
    assert isinstance(events[-1], TurnFinished)
    stopped = next(event for event in events if isinstance(event, PromptSkipped) and event.reason == "stopped")
    assert stopped.prompt_tokens == len(prompt) and 0 < stopped.read_tokens < len(prompt)
    assert not [event for event in events if isinstance(event, TextDelta)]
    assert events[-1].stats.stop_reason == "interrupted" and events[-1].stats.generated_tokens == 0
    assert session.transcript[-1] == {"role": "assistant", "content": ""}
    # What was read stays consistent: the cache and its record agree, and the conversation goes on.
    assert session.cache.is_consistent() and len(session.cache_view().token_ids) == session.cache_stats().used
    assert session.cache_stats().seen == stopped.read_tokens + len(session.chat_format.end_of_turn_ids)
    assert run(session.chat("And now?"))[-1].stats.generated_tokens == 8


def read_alone(
    reading: Reading, model, asked: list[bool], stop_after: int | None = None
) -> tuple[list[list[int]], list[object]]:
    """Drive `reading` a pass at a time, as an engine's steps would; the chunks it read and what it said. With
    `stop_after`, a stop is asked for (`asked`) once that many chunks were read."""
    chunks, said = [], []
    while (work := reading.next_work()) is not None:
        chunks.append(work.ids[0].tolist())
        with torch.inference_mode():
            fed = Fed(*forward(model, reading.cache, work.ids, label=work.label))
        if len(chunks) == stop_after:
            asked.append(True)
        advanced = reading.advance(fed)
        said += advanced.events
        if not advanced.goes_on:
            break
    reading.end(None)
    return chunks, said


@pytest.mark.parametrize("stop_after", [None, 2])
def test_a_reading_reads_a_chunk_a_pass_counts_its_skips_and_heeds_a_stop_once_it_has_logits(stop_after):
    model = tiny_model("llama", vocab_size=VOCAB)
    cache = SinkCache.for_model(model, 4, 16)
    head, tail = list(range(3, 23)), list(range(30, 40))
    progress, asked = ReadingProgress(30, 8), []
    reading = Reading(
        cache,
        [(head, 7), (tail, 0)],
        2,
        8,
        lambda eviction: eviction,
        progress=progress,
        occupancy=True,
        stop_requested=lambda: bool(asked),
    )
    chunks, events = read_alone(reading, model, asked, stop_after)
    expected = [head[:8], head[8:16], head[16:], tail[:8], tail[8:]]
    if stop_after is None:
        assert chunks == expected and not reading.stopped
        assert (cache.stats().seen, cache.stats().evicted, cache.ledger.skipped) == (30, 30 - 20, 7)
        assert [event.read_tokens for event in events if isinstance(event, PromptProgress)] == [8, 16, 20, 28, 30]
        assert sum(isinstance(event, CacheOccupancy) for event in events) == 5
        assert [type(event).__name__ for event in events[-3:]] == ["Eviction", "PromptProgress", "CacheOccupancy"]
    else:
        assert chunks == expected[:2] and reading.stopped
        assert (cache.stats().seen, cache.ledger.skipped) == (16, 0)  # stopped before the skip
    # The logits after its last chunk: those of the same tokens fed alone.
    again = SinkCache.for_model(model, 4, 16)
    for chunk, skipped in zip(chunks, [0, 0, 7, 0, 0], strict=False):
        logits, _ = forward(model, again, torch.tensor([chunk]), label=2)
        again.count_skipped(skipped, 2)
    assert torch.equal(reading.logits, logits)


def test_a_benchmark_s_prompt_is_read_a_prefill_chunk_a_step_of_the_engine_s_runner(monkeypatch):
    model = tiny_model("llama", vocab_size=VOCAB)
    ids = torch.randint(3, VOCAB, (1, 700), generator=torch.Generator().manual_seed(2))
    cache, alone = SinkCache.for_model(model, 4, 300), SinkCache.for_model(model, 4, 300)
    steps, run = [], Runner.run

    def counted(runner: Runner, scheduled: Scheduled) -> list[Fed]:
        steps.append([ticket.work.tokens for ticket in scheduled.tickets])
        return run(runner, scheduled)

    monkeypatch.setattr(Runner, "run", counted)
    logits = read_prompt(model, cache, ids[0].tolist())
    chunk = defaults.PREFILL_CHUNK
    assert steps == [[chunk], [chunk], [700 - 2 * chunk]]  # the window (300) holds a whole chunk
    with torch.inference_mode():
        for start in range(0, 700, chunk):
            expected, _ = forward(model, alone, ids[:, start : start + chunk])
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert cache.stats() == alone.stats() and cache.stats().evicted > 0
    assert cache.held_tokens() == alone.held_tokens()


def test_a_prompt_is_read_a_window_a_pass_where_the_window_is_smaller_than_a_chunk_and_never_empty():
    model = tiny_model("llama", vocab_size=VOCAB)
    cache, alone = SinkCache.for_model(model, 4, 16), SinkCache.for_model(model, 4, 16)
    ids = list(range(3, 43))
    logits = read_prompt(model, cache, ids)
    with torch.inference_mode():
        for start in range(0, 40, 16):
            expected, _ = forward(model, alone, torch.tensor([ids[start : start + 16]]))
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    assert cache.stats() == alone.stats()
    with pytest.raises(ConfigError, match="at least one token"):
        read_prompt(model, cache, [])
