"""Sinks read once and copied into every conversation that begins alike: the copy is the cache that read them."""

from __future__ import annotations

import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.shared_sinks import SharedSinks
from tests.support.models import tiny_model

SINKS = [5, 9, 14, 3, 22]
WINDOW = 24
READER = "a reading"  # what reads them, for others to wait on (a request, to the engine)


def sinks_read(model, ids: list[int] = SINKS, label: int = 0) -> SinkCache:
    cache = SinkCache.for_model(model, len(ids), WINDOW)
    forward(model, cache, torch.tensor([ids]), label=label)
    return cache


def test_the_first_conversation_reads_the_sinks_the_next_wait_then_copy_them_exactly():
    model = tiny_model("llama")
    shared = SharedSinks()
    first, second = (SinkCache.for_model(model, len(SINKS), WINDOW) for _ in range(2))
    assert shared.take(first, SINKS, 0, "first's reading") == "read"
    assert shared.take(second, SINKS, 0, "second's reading") == "wait"  # the first one is reading them
    assert shared.reader(second, SINKS, 0) == "first's reading"  # what the second waits for
    forward(model, first, torch.tensor([SINKS]), label=0)
    shared.keep(first, SINKS, 0)
    assert shared.take(second, SINKS, 0, READER) == "copied" and shared.copies == 1
    mine, theirs = CacheSnapshot.whole(first).tensors(), CacheSnapshot.whole(second).tensors()
    assert mine.keys() == theirs.keys()
    for name, tensor in mine.items():
        assert torch.equal(theirs[name], tensor), name
    # and the conversation goes on from the copy exactly as from the sinks it read: past the window, evicting
    for start in (30, 50):  # two chunks, the second evicting
        chunk = torch.arange(start, start + 16)[None]
        assert torch.equal(forward(model, second, chunk).logits, forward(model, first, chunk).logits)
    assert second.held_tokens() == first.held_tokens() and first.stats().evicted > 0


def test_a_copy_into_a_used_cache_is_the_sinks_alone():
    model = tiny_model("llama")
    shared = SharedSinks()
    reader = SinkCache.for_model(model, len(SINKS), WINDOW)
    shared.take(reader, SINKS, 0, READER)
    forward(model, reader, torch.tensor([SINKS]), label=0)
    shared.keep(reader, SINKS, 0)
    used = sinks_read(model, [7, 7, 7, 7, 7])  # a conversation before, emptied for the next (the server's pool)
    forward(model, used, torch.arange(40, 60)[None])
    used.reset()
    assert shared.take(used, SINKS, 0, READER) == "copied"
    for name, tensor in CacheSnapshot.whole(sinks_read(model)).tensors().items():
        assert torch.equal(CacheSnapshot.whole(used).tensors()[name], tensor), name


def test_sinks_a_reader_gave_up_are_read_by_the_next_conversation():
    model = tiny_model("llama")
    shared = SharedSinks()
    cache = SinkCache.for_model(model, len(SINKS), WINDOW)
    assert shared.take(cache, SINKS, 0, READER) == "read"
    shared.forget_reading(cache, SINKS, 0)  # stopped, or abandoned, before they were read
    assert shared.take(cache, SINKS, 0, READER) == "read"


def test_only_the_same_tokens_label_and_cache_shape_share_and_the_least_recently_taken_go_first():
    model = tiny_model("llama")
    shared = SharedSinks(limit=2)
    shared.keep(sinks_read(model), SINKS, 0)
    other = [6, 9, 14, 3, 22]
    assert shared.take(SinkCache.for_model(model, 5, WINDOW), other, 0, READER) == "read"  # other tokens
    assert shared.take(SinkCache.for_model(model, 5, WINDOW), SINKS, 2, READER) == "read"  # recorded as another message
    assert shared.take(SinkCache.for_model(model, 5, WINDOW + 8), SINKS, 0, READER) == "read"  # another window
    shared.keep(sinks_read(model, other), other, 0)
    assert shared.take(SinkCache.for_model(model, 5, WINDOW), SINKS, 0, READER) == "copied"  # the first, taken again
    shared.keep(sinks_read(model, SINKS, 2), SINKS, 2)  # a third kind: `other`, least recently taken, goes
    assert shared.take(SinkCache.for_model(model, 5, WINDOW), other, 0, READER) == "read"
    assert shared.take(SinkCache.for_model(model, 5, WINDOW), SINKS, 0, READER) == "copied"
