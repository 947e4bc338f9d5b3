"""A turn's engine requests. Readings: long prompts read as replays read a conversation, or every token with
progress; a stop() between passes. Replies: decoded in the engine's shared steps they equal the same replies decoded
alone, row by row (tokens, caches, sampling); a benchmark's endless reply feeds the model's own greedy tokens."""

from __future__ import annotations

import copy
import time

import pytest
import torch

from streamchat import defaults
from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.engine import Engine, Runner
from streamchat.engine.scheduler import Scheduled
from streamchat.engine.work import Advanced, DecodeRow, Fed
from streamchat.errors import ConfigError
from streamchat.generation.decoder import Decoder
from streamchat.generation.events import (
    CacheOccupancy,
    PromptProgress,
    PromptSkipped,
    PromptTruncated,
    TextDelta,
    TurnFinished,
)
from streamchat.generation.requests import (
    REPLAYED_WINDOWS,
    Reading,
    ReadingProgress,
    Reply,
    endless_reply,
    prompt_parts,
    read_prompt,
    replayed_count,
    replayed_parts,
)
from streamchat.generation.sampling import Sampler
from streamchat.generation.settings import GenerationSettings
from streamchat.placement.fusion import fuse_projections
from tests.conversation.test_session import make_session, run
from tests.generation.test_decoder import _LateReader
from tests.support.models import VOCAB, tiny_model
from tests.support.tokenizers import byte_level_tokenizer

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


WINDOW = 48
GREEDY = GenerationSettings(temperature=0.0)
SAMPLED = GenerationSettings(temperature=0.8, top_p=0.9, repetition_penalty=1.3)
# Each row counts its own reply's tokens.
PENALIZED = GenerationSettings(temperature=0.8, top_p=0.9, frequency_penalty=0.6, presence_penalty=0.4)
GREEDY_PENALIZED = GenerationSettings(temperature=0.0, frequency_penalty=0.3, presence_penalty=1.0)


class Conversation:
    """One row: its own sinks, prompt, settings and seed; joins at round `joins`, decodes `count` tokens."""

    def __init__(self, model, sinks: int, prompt: int, count: int, joins: int, settings, seed: int) -> None:
        self.sinks, self.prompt, self.count, self.joins = sinks, prompt, count, joins
        self.settings, self.seed = settings, seed
        self.cache = SinkCache.for_model(model, sinks, WINDOW)
        ids = torch.randint(3, VOCAB, (1, prompt), generator=torch.Generator().manual_seed(seed))
        self.decoder = Decoder(self.cache, vocab_size=VOCAB)
        self.decoder.start(forward(model, self.cache, ids).logits, settings, Sampler(seed=seed))
        self.model = model
        self.tokens: list[int] = []
        self.ended = False

    def alone(self, count: int | None = None) -> list[int]:
        """Its next `count` tokens (its reply's), decoded in an engine of its own: one row a step."""
        next_token = endless_reply(self.model, self.decoder)
        return [next_token().token for _ in range(count or self.count)]

    # ---- a request of the engine's (engine/work.py: Request): `count` tokens, drawn and fed as a reply's are ----

    def next_work(self) -> DecodeRow:
        drawn = self.decoder.draw()
        self.decoder.checkpoint()
        return DecodeRow(self.cache, drawn.on_device, drawn.token_id)

    def advance(self, fed: Fed) -> Advanced:
        token = self.decoder.fed(fed.logits)  # None: a guess drawn again, its step taken back
        if token is not None:
            self.tokens.append(token)
        return Advanced((), len(self.tokens) < self.count)

    def end(self, error: BaseException | None) -> None:
        assert error is None
        self.ended = True


def run_rounds(engine: Engine, conversations: list[Conversation]) -> int:
    """Replies joining at their round, each decoding in the engine's steps until it ends; the most rows one step
    fed."""
    waiting, widest, rounds = sorted(conversations, key=lambda c: c.joins), 0, 0
    while waiting or not all(conversation.ended for conversation in conversations):
        while waiting and waiting[0].joins <= rounds:
            engine.submit(waiting.pop(0))
        if engine.has_work():
            fed = engine.rows_fed
            engine.step()
            widest = max(widest, engine.rows_fed - fed)
        rounds += 1
    return widest


def conversations(model, settings) -> list[Conversation]:
    # Different sinks, prompt lengths (so positions and sink shifts differ), lengths and arrival times:
    # the window fills and evicts in every row, rows join and leave while others decode.
    return [
        Conversation(model, 4, 20, 90, 0, settings, 1),
        Conversation(model, 7, 40, 60, 5, settings, 2),
        Conversation(model, 2, 5, 120, 0, settings, 3),
        Conversation(model, 4, 44, 30, 40, settings, 4),
        Conversation(model, 9, 30, 70, 12, settings, 5),
    ]


@pytest.mark.parametrize("model_type", ["llama", "llama-fused", "gemma2"])
@pytest.mark.parametrize(
    "settings",
    [GREEDY, SAMPLED, PENALIZED, GREEDY_PENALIZED],
    ids=["greedy", "sampled", "penalized", "greedy-penalized"],
)
def test_every_row_of_a_batch_decodes_the_tokens_it_decodes_alone(model_type, settings):
    # float32; gemma2 has sliding layers beside the sink layers; fused llama runs the lean forward
    model = tiny_model(model_type.removesuffix("-fused"))
    if model_type.endswith("-fused"):
        model = copy.deepcopy(model)  # fusing works in place; tiny_model's models are shared
        fuse_projections(model)
        assert Engine(model).runner.lean is not None
    alone = [conversation.alone() for conversation in conversations(model, settings)]
    batched = conversations(model, settings)
    engine = Engine(model)
    widest = run_rounds(engine, batched)
    assert widest == 5  # every row decoded together at some point
    assert engine.runner.members == [] and engine.steps < sum(c.count for c in batched)
    assert [conversation.tokens for conversation in batched] == alone
    assert len({tuple(tokens) for tokens in alone}) == len(alone)  # five different streams
    assert all(conversation.cache.stats().evicted > 0 for conversation in batched)


def test_rows_fed_before_the_host_reads_their_tokens_decode_the_tokens_read_first():
    """The order on a GPU (generation/decoder.py), on the CPU: each row's token is fed as drawn and read after the
    step; a guess its shortlist could not decide is taken back and drawn again, the others' rows going on."""
    model = tiny_model("llama")
    alone = [conversation.alone() for conversation in conversations(model, SAMPLED)]
    batched = conversations(model, SAMPLED)
    for conversation in batched:
        conversation.decoder._reader = _LateReader()
    engine = Engine(model)
    run_rounds(engine, batched)
    assert [conversation.tokens for conversation in batched] == alone
    assert engine.rows_fed > sum(len(tokens) for tokens in alone)  # guesses were fed, and taken back


def test_a_cache_after_a_batch_holds_what_it_holds_decoded_alone_and_owns_its_storage():
    model = tiny_model("llama")
    alone = conversations(model, SAMPLED)
    for conversation in alone:
        conversation.alone()
    batched = conversations(model, SAMPLED)
    run_rounds(Engine(model), batched)
    for one, other in zip(alone, batched, strict=True):
        mine, theirs = CacheSnapshot.whole(one.cache).tensors(), CacheSnapshot.whole(other.cache).tensors()
        assert mine.keys() == theirs.keys()
        for name in mine:
            torch.testing.assert_close(theirs[name], mine[name], rtol=0, atol=1e-5, msg=name)
        for layer in other.cache.layers:
            assert layer.keys._base is None and layer.keys.is_contiguous()  # no view of the pool left
    # ... and each goes on decoding alone exactly as the one never batched
    for one, other in zip(alone, batched, strict=True):
        assert other.alone(20) == one.alone(20)


def test_a_benchmark_s_engine_steps_feed_the_greedy_tokens_of_the_model_s_own_forward():
    model = copy.deepcopy(tiny_model("llama", vocab_size=VOCAB))
    fuse_projections(model)  # the lean pass, as the chat's engine runs it
    ids = torch.randint(3, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    cache, reference = SinkCache.for_model(model, 4, 12), SinkCache.for_model(model, 4, 12)
    decoder = Decoder(cache, vocab_size=VOCAB)
    decoder.start(forward(model, cache, ids).logits, GREEDY, Sampler(0))
    next_token = endless_reply(model, decoder)
    logits, expected = forward(model, reference, ids).logits, []
    for _ in range(20):  # past the window: evicting
        expected.append(int(logits[0, -1].argmax()))
        logits = forward(model, reference, torch.tensor([expected[-1:]])).logits
    assert [next_token().token for _ in range(20)] == expected
    assert cache.held_tokens() == reference.held_tokens()
    assert cache.stats() == reference.stats() and cache.stats().evicted > 0


# ---- Reply: a reply's text as it grows, stop strings that straddle tokens, its stats ----


def grow(text: str, stop: tuple[str, ...] = ()) -> tuple[Reply, list[str]]:
    """Feed `text` one byte-level token per character until the reply stops."""
    tokenizer = byte_level_tokenizer()
    started = time.perf_counter() - 1.0
    reply = Reply(tokenizer, GenerationSettings(max_new_tokens=100, stop=stop), started, prefilled=started + 0.25)
    shown = []
    for character in text:
        for token in tokenizer.encode(character, add_special_tokens=False):
            shown.append(reply.add(token))
        if reply.reason == "stop_string":
            break
    shown.append(reply.flush())
    return reply, shown


def test_without_stop_strings_every_token_shows_and_the_text_is_whole():
    reply, shown = grow("Hello, wörld")
    assert "".join(shown) == reply.text == "Hello, wörld"
    assert reply.reason == "max_new_tokens"


def test_a_stop_string_across_tokens_cuts_the_text_before_it():
    reply, shown = grow("one two END three", stop=("END",))
    assert reply.text == "".join(shown) == "one two "
    assert reply.reason == "stop_string"


def test_the_earliest_of_several_stop_strings_wins():
    reply, _ = grow("abc xyz def", stop=("def", " xy"))
    assert reply.text == "abc"


def test_stats_count_the_tokens_and_time_the_prompt_the_first_token_and_the_rest():
    reply, _ = grow("hello there")
    stats = reply.stats(prompt_tokens=7)
    assert stats.prompt_tokens == 7 and stats.generated_tokens == len(reply.ids) == 11
    assert stats.prefill_seconds == 0.25 and stats.time_to_first_token >= 1.0
    assert stats.decode_seconds >= 0 and stats.stop_reason == "max_new_tokens"


def test_text_that_may_begin_a_stop_string_waits_until_it_cannot():
    reply, shown = grow("xEN yEN", stop=("END",))
    assert shown == ["x", "", "", "EN ", "y", "", "", "EN"]  # " " rules out "END"; the reply end releases the rest
    assert reply.text == "xEN yEN" and reply.reason == "max_new_tokens"


def test_the_stop_string_that_ended_a_reply_is_the_earliest_in_its_text():
    reply, _ = grow("one two three", stop=("three", "two", "e t"))
    assert (reply.text, reply.reason, reply.stop_string) == ("on", "stop_string", "e t")
    assert reply.stats(prompt_tokens=1).stop_string == "e t"
    assert grow("one two three", stop=("three", "two"))[0].stop_string == "two"
    assert grow("one two")[0].stop_string is None
