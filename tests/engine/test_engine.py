"""The engine's step: draw, schedule, one pass, settle; a failure reaches every request of its step. Its run
phase: one step's rows and chunks in one forward pass give what each gives read alone (float32), and the caches
hold the same: through the lean ragged pass (fused llama-family models) and the model's own forward (others)."""

from __future__ import annotations

import copy

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.batch import CacheBatch
from streamchat.cache.feeding import model_logits
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.engine import Engine, Runner
from streamchat.engine.scheduler import Scheduled
from streamchat.engine.work import Advanced, DecodeRow, Fed, PromptChunk, Ticket
from streamchat.errors import CacheStateError
from streamchat.placement.fusion import fuse_projections
from tests.support.models import VOCAB, tiny_model


def read(model, sinks: int, length: int) -> SinkCache:
    cache = SinkCache.for_model(model, sinks, 40)
    forward(model, cache, torch.arange(3, 3 + length)[None])
    return cache


class Once:
    """A request (engine/work.py) of one piece of work, recording what the engine told it."""

    def __init__(self, work) -> None:
        self.work, self.cache = work, work.cache
        self.fed: list[Fed] = []
        self.ended: tuple[BaseException | None] | None = None

    def next_work(self):
        return self.work

    def advance(self, fed: Fed) -> Advanced:
        self.fed.append(fed)
        return Advanced(("read",), False)

    def end(self, error: BaseException | None) -> None:
        self.ended = (error,)


def submitted(engine: Engine, work) -> Once:
    request = Once(work)
    engine.submit(request)
    return request


def test_a_step_feeds_rows_and_chunks_together_and_counts_them():
    model = tiny_model("llama")
    engine = Engine(model, token_budget=64)
    decoding, reading = read(model, 4, 10), SinkCache.for_model(model, 4, 40)
    row = submitted(engine, DecodeRow(decoding, torch.tensor([5])))
    chunk = submitted(engine, PromptChunk(reading, torch.arange(3, 15)[None]))
    assert engine.has_work() and row.ended is None
    outputs = engine.step()
    said = [(o.request, o.events, o.ended, o.error) for o in outputs]
    assert said == [(row, ("read",), True, None), (chunk, ("read",), True, None)]
    assert row.ended == chunk.ended == (None,) and not engine.has_work()
    assert row.fed[0].logits.shape == chunk.fed[0].logits.shape == (1, 1, VOCAB)
    assert (engine.steps, engine.rows_fed, engine.chunk_tokens) == (1, 1, 12)
    assert decoding.stats().seen == 11 and reading.stats().seen == 12
    assert engine.runner.members == []  # one reply decodes through its own cache: no pool


def test_chunks_past_the_step_s_token_budget_wait_for_the_next_step_in_the_order_they_came():
    model = tiny_model("llama")
    engine = Engine(model, token_budget=16)
    first, second, third = (SinkCache.for_model(model, 4, 40) for _ in range(3))
    chunks = [submitted(engine, PromptChunk(cache, torch.arange(3, 13)[None])) for cache in (first, second, third)]
    engine.step()
    assert [chunk.ended for chunk in chunks] == [(None,), None, None]  # the oldest always goes; 20 > 16
    engine.step()
    assert [chunk.ended for chunk in chunks] == [(None,), (None,), None]
    engine.step()
    assert all(chunk.ended == (None,) for chunk in chunks) and not engine.has_work()


def test_replies_share_the_pool_while_two_decode_and_the_last_one_leaves_it_alone():
    model = tiny_model("llama")
    engine = Engine(model)
    first, second = read(model, 4, 10), read(model, 5, 12)
    replies = [ScriptedReply(cache, [5, 6]) for cache in (first, second)]
    for reply in replies:
        engine.submit(reply)
    engine.step()
    assert engine.runner.members == [first, second]
    engine.leave(first)
    assert engine.runner.members == []  # the last one owns its storage again
    assert second.layers[0].keys._base is None
    engine.step()
    assert second.stats().seen == 14 and engine.rows_fed == 3 and replies[0].ended is None


def test_a_failed_step_fails_every_request_in_it_and_the_engine_goes_on():
    model = tiny_model("llama")
    engine = Engine(model)
    short = SinkCache.for_model(model, 4, 40)  # sinks not filled: it cannot be a decode row
    other = SinkCache.for_model(model, 4, 40)
    bad = submitted(engine, DecodeRow(short, torch.tensor([5])))
    bystander = submitted(engine, PromptChunk(other, torch.arange(3, 9)[None]))
    engine.step()
    for request in (bad, bystander):
        assert isinstance(request.ended[0], CacheStateError) and "sinks filled" in str(request.ended[0])
    assert engine.steps == 0 and not engine.has_work()
    again = submitted(engine, PromptChunk(SinkCache.for_model(model, 4, 40), torch.arange(3, 9)[None]))
    engine.step()
    assert again.ended == (None,) and again.fed[0].logits.shape == (1, 1, VOCAB)


def test_a_request_left_behind_is_never_fed():
    model = tiny_model("llama")
    engine = Engine(model, token_budget=8)
    reading, waiting, leaving = SinkCache.for_model(model, 4, 40), SinkCache.for_model(model, 4, 40), read(model, 4, 10)
    submitted(engine, PromptChunk(reading, torch.arange(3, 9)[None]))
    queued = submitted(engine, PromptChunk(waiting, torch.arange(3, 9)[None]))  # past the budget: queued
    left = submitted(engine, DecodeRow(leaving, torch.tensor([5])))
    engine.leave(leaving)
    engine.step()
    engine.leave(waiting)
    assert not engine.has_work()
    engine.step()
    assert queued.ended is None and left.ended is None
    assert waiting.stats().seen == 0 and leaving.stats().seen == 10 and reading.stats().seen == 6


class ScriptedReply:
    """A reply (engine/work.py: Request) that feeds `tokens` one per step, recording what the engine asked and told
    it."""

    def __init__(self, cache: SinkCache, tokens: list[int], fail_at: int | None = None) -> None:
        self.cache, self.tokens, self.fail_at = cache, tokens, fail_at
        self.drawn: list[int] = []
        self.fed: list[Fed] = []
        self.stop = False
        self.ended: tuple[BaseException | None] | None = None

    def next_work(self):
        if self.stop:
            return None
        if len(self.drawn) == self.fail_at:
            raise RuntimeError("the sampler failed")
        self.drawn.append(self.tokens[len(self.drawn)])
        return DecodeRow(self.cache, torch.tensor([self.drawn[-1]]), self.drawn[-1])

    def advance(self, fed: Fed) -> Advanced:
        self.fed.append(fed)
        return Advanced((self.drawn[-1],), len(self.fed) < len(self.tokens))  # it says its token

    def end(self, error: BaseException | None) -> None:
        self.ended = (error,)


def test_replies_draw_at_each_step_and_each_leaves_the_pool_in_the_step_it_ends():
    model = tiny_model("llama")
    engine = Engine(model)
    short, long = ScriptedReply(read(model, 4, 10), [5, 6]), ScriptedReply(read(model, 4, 12), [7, 8, 9, 10])
    for reply in (short, long):
        engine.submit(reply)
    engine.step()
    assert engine.runner.members == [short.cache, long.cache] and short.drawn == [5] and short.ended is None
    engine.step()
    assert short.ended == (None,) and engine.runner.members == []  # the last one decodes alone again
    while engine.has_work():
        engine.step()
    assert long.ended == (None,) and long.drawn == [7, 8, 9, 10] and len(long.fed) == 4
    assert short.cache.stats().seen == 12 and long.cache.stats().seen == 16
    assert (engine.steps, engine.rows_fed) == (4, 6)


def test_a_stop_asked_between_steps_ends_a_reply_before_another_token_is_drawn():
    model = tiny_model("llama")
    engine = Engine(model)
    reply = ScriptedReply(read(model, 4, 10), [5, 6, 7])
    engine.submit(reply)
    engine.step()
    reply.stop = True
    [output] = engine.step()  # nothing left to run but its end
    assert (output.request, output.events, output.ended, output.error) == (reply, (), True, None)
    assert reply.ended == (None,) and reply.drawn == [5] and reply.cache.stats().seen == 11
    assert not engine.has_work()


def test_a_reply_whose_draw_or_pass_fails_ends_with_the_failure_and_the_others_go_on():
    model = tiny_model("llama")
    engine = Engine(model)
    failing, going_on = ScriptedReply(read(model, 4, 10), [5, 6], fail_at=1), ScriptedReply(read(model, 4, 10), [5, 6])
    for reply in (failing, going_on):
        engine.submit(reply)
    assert [(o.request, o.events, o.ended) for o in engine.step()] == [(failing, (5,), False), (going_on, (5,), False)]
    ended, said = engine.step()  # the one that fails at its draw ends first, before the pass
    assert (ended.request, ended.ended, str(ended.error)) == (failing, True, "the sampler failed")
    assert (said.request, said.events, said.ended) == (going_on, (6,), True)
    assert isinstance(failing.ended[0], RuntimeError) and failing.drawn == [5]
    assert going_on.ended == (None,) and len(going_on.fed) == 2
    torn = ScriptedReply(SinkCache.for_model(model, 4, 40), [5])  # sinks not filled: it cannot be a decode row
    engine.submit(torn)
    engine.step()
    assert isinstance(torn.ended[0], CacheStateError) and not engine.has_work()


WINDOW = 40


def model_for(name: str) -> torch.nn.Module:
    model = tiny_model(name.removesuffix("-fused"))
    if name.endswith("-fused"):
        model = copy.deepcopy(model)  # fusing works in place; tiny_model's models are shared
        fuse_projections(model)
    return model


def ids(count: int, seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, count), generator=torch.Generator().manual_seed(seed))


def caches(model, prompts: list[int]) -> list[SinkCache]:
    """A cache per conversation, its prompt read (different sinks and lengths: different positions)."""
    made = []
    for index, length in enumerate(prompts):
        cache, prompt = SinkCache.for_model(model, 3 + index, WINDOW), ids(length, index)
        for start in range(0, length, WINDOW):  # a pass holds at most the window
            forward(model, cache, prompt[:, start : start + WINDOW])
        made.append(cache)
    return made


@pytest.mark.parametrize("decoding", [2, 1], ids=["pooled rows", "one reply alone"])
@pytest.mark.parametrize("name", ["llama-fused", "qwen2-fused", "gemma2", "llama"])
def test_a_chunk_sharing_a_pass_with_decode_rows_gives_what_it_gives_read_alone(name, decoding):
    # gemma2 has sliding layers beside the sink layers; the fused models run the ragged lean pass
    model = model_for(name)
    runner = Runner(model)
    assert (runner.lean is not None) == name.endswith("-fused")
    # two replies decoding (one of them evicting), one conversation reading a chunk, one its first
    mixed = caches(model, [12, 44, 9, 0])
    alone = [copy.deepcopy(cache) for cache in mixed]
    tokens = [torch.tensor([5]), torch.tensor([7])][:decoding]
    chunk, first = ids(17, 10), ids(6, 11)

    scheduled = Scheduled(
        rows=[Ticket(DecodeRow(cache, token), None) for cache, token in zip(mixed, tokens, strict=False)],
        chunks=[Ticket(PromptChunk(mixed[2], chunk), None), Ticket(PromptChunk(mixed[3], first), None)],
    )
    outcomes = runner.run(scheduled)
    assert len(runner.members) == (decoding if decoding > 1 else 0)  # one reply alone decodes through its own cache
    for cache in mixed[:decoding]:
        runner.leave(cache)

    pool = CacheBatch()
    for cache in alone[:decoding]:
        pool.join(cache)
    with pool.decode_pass(tokens) as opened:
        rows = model_logits(model, pool, opened.input_ids, opened.inputs)  # [rows, 1, vocab]
    for cache in alone[:decoding]:
        pool.leave(cache)
    expected = [rows[0:1], rows[1:2]][:decoding]
    expected += [forward(model, alone[2], chunk).logits, forward(model, alone[3], first).logits]

    assert [outcome.logits.shape for outcome in outcomes] == [(1, 1, VOCAB)] * (decoding + 2)
    for outcome, logits in zip(outcomes, expected, strict=True):
        torch.testing.assert_close(outcome.logits, logits, rtol=0, atol=1e-5)
        assert outcome.logits.argmax() == logits.argmax()
    evictions = [outcome.eviction.count if outcome.eviction else 0 for outcome in outcomes]
    assert evictions == [*[0, 1][:decoding], 0, 0]  # the second reply's sinks and window were full
    for one, other in zip(alone, mixed, strict=True):
        mine, theirs = CacheSnapshot.whole(one).tensors(), CacheSnapshot.whole(other).tensors()
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(theirs[key], mine[key], rtol=0, atol=1e-5, msg=key)
