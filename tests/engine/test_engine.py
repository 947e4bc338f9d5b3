"""The engine's step: schedule, one pass, every ticket settled; a failure reaches every ticket of its step."""

from __future__ import annotations

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.engine.engine import Engine
from streamchat.engine.work import DecodeRow, PromptChunk
from streamchat.errors import CacheStateError
from tests.support.models import VOCAB, tiny_model


def read(model, sinks: int, length: int) -> SinkCache:
    cache = SinkCache.for_model(model, sinks, 40)
    forward(model, cache, torch.arange(3, 3 + length)[None])
    return cache


def test_a_step_feeds_rows_and_chunks_together_and_counts_them():
    model = tiny_model("llama")
    engine = Engine(model, token_budget=64)
    decoding, reading = read(model, 4, 10), SinkCache.for_model(model, 4, 40)
    row = engine.queue(DecodeRow(decoding, torch.tensor([5])))
    chunk = engine.queue(PromptChunk(reading, torch.arange(3, 15)[None]))
    assert engine.has_work() and not row.done
    engine.step()
    assert row.done and chunk.done and not engine.has_work()
    assert row.result().logits.shape == chunk.result().logits.shape == (1, 1, VOCAB)
    assert (engine.steps, engine.rows_fed, engine.chunk_tokens) == (1, 1, 12)
    assert decoding.stats().seen == 11 and reading.stats().seen == 12
    assert engine.runner.members == []  # one reply decodes through its own cache: no pool


def test_replies_share_the_pool_while_two_decode_and_the_last_one_leaves_it_alone():
    model = tiny_model("llama")
    engine = Engine(model)
    first, second = read(model, 4, 10), read(model, 5, 12)
    for cache in (first, second):
        engine.queue(DecodeRow(cache, torch.tensor([5])))
    engine.step()
    assert engine.runner.members == [first, second]
    engine.leave(first)
    assert engine.runner.members == []  # the last one owns its storage again
    assert second.layers[0].keys._base is None
    engine.queue(DecodeRow(second, torch.tensor([6])))
    engine.step()
    assert second.stats().seen == 14 and engine.rows_fed == 3


def test_a_failed_step_fails_every_ticket_in_it_and_the_engine_goes_on():
    model = tiny_model("llama")
    engine = Engine(model)
    short = SinkCache.for_model(model, 4, 40)  # sinks not filled: it cannot be a decode row
    other = SinkCache.for_model(model, 4, 40)
    bad = engine.queue(DecodeRow(short, torch.tensor([5])))
    bystander = engine.queue(PromptChunk(other, torch.arange(3, 9)[None]))
    engine.step()
    for ticket in (bad, bystander):
        with pytest.raises(CacheStateError, match="sinks filled"):
            ticket.result()
    assert engine.steps == 0
    again = engine.queue(PromptChunk(SinkCache.for_model(model, 4, 40), torch.arange(3, 9)[None]))
    engine.step()
    assert again.result().logits.shape == (1, 1, VOCAB)


def test_work_withdrawn_or_left_behind_is_never_fed():
    model = tiny_model("llama")
    engine = Engine(model)
    withdrawn_cache, leaving = SinkCache.for_model(model, 4, 40), read(model, 4, 10)
    withdrawn = engine.queue(PromptChunk(withdrawn_cache, torch.arange(3, 9)[None]))
    left = engine.queue(DecodeRow(leaving, torch.tensor([5])))
    engine.withdraw(withdrawn)
    engine.leave(leaving)
    assert not engine.has_work()
    engine.step()
    assert not withdrawn.done and not left.done
    assert withdrawn_cache.stats().seen == 0 and leaving.stats().seen == 10
