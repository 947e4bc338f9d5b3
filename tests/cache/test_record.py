"""The cache's record: which token each held slot has and its label, in stream order, through every kind of pass."""

from __future__ import annotations

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.batch import CacheBatch
from streamchat.cache.feeding import model_logits
from streamchat.cache.ledger import NO_LABEL
from streamchat.cache.record import UNREAD, HeldTokens
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.errors import CacheStateError
from tests.support.models import tiny_model

SINKS, WINDOW = 2, 4


def feed(model, cache: SinkCache, token_ids: list[int], label: int):
    return forward(model, cache, torch.tensor([token_ids]), label=label).eviction


def decode(model, cache: SinkCache, token: int, label: int, token_id: int | None = None):
    """One decode pass of `token`; the host names it before the pass (token_id) or learns it after."""
    known = token if token_id is None else token_id
    with cache.decode_pass(label, known) as eviction:
        tensor = torch.tensor([[token]])
        model_logits(model, cache, tensor, cache.decode_inputs(tensor))
    return eviction


def test_chunks_fill_the_sinks_then_the_window_and_evictions_say_which_tokens_left():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    assert feed(model, cache, [10, 11, 12], label=0) is None
    assert feed(model, cache, [20, 21, 22], label=1) is None
    eviction = feed(model, cache, [30, 31], label=2)  # 3 + 3 + 2 tokens: two leave the window
    assert (eviction.count, eviction.token_ids) == (2, (12, 20))
    assert cache.held_tokens() == HeldTokens(
        sink_ids=(10, 11),
        sink_labels=(0, 0),
        window_ids=(21, 22, 30, 31),
        window_labels=(1, 1, 2, 2),
        forgotten=2,
        last_forgotten_label=1,
    )
    assert cache.held_tokens().token_ids == [10, 11, 21, 22, 30, 31]


def test_a_skipped_middle_is_forgotten_without_being_held():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, cache, [10, 11, 12], label=0)
    cache.count_skipped(40, label=1)
    cache.count_skipped(0, label=7)  # nothing skipped: nothing changes
    feed(model, cache, [13], label=1)
    held = cache.held_tokens()
    assert (held.window_ids, held.window_labels) == ((12, 13), (0, 1))
    assert (held.forgotten, held.last_forgotten_label) == (40, 1)
    assert cache.stats().evicted == 0 and cache.ledger.skipped == 40


def test_decode_passes_record_their_token_known_before_or_learned_after_and_wrap_the_ring():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, cache, [10, 11, 12, 13, 14, 15], label=0)  # the window is full: each pass evicts one
    assert decode(model, cache, 50, label=1).token_ids == (12,)
    assert decode(model, cache, 51, label=1, token_id=UNREAD).token_ids == (13,)
    assert cache.held_tokens().window_ids == (14, 15, 50, UNREAD)  # read back a pass late
    cache.learn_token(51)
    for token in (52, 53, 54):  # the ring wraps
        decode(model, cache, token, label=3)
    held = cache.held_tokens()
    assert held.window_ids == (51, 52, 53, 54) and held.window_labels == (1, 3, 3, 3)
    assert (held.forgotten, held.last_forgotten_label) == (5, 1)
    assert cache.occupancy.token_ids.tolist() == cache.record.token_ids  # the device's ids agree, slot by slot


def test_a_pass_taken_back_leaves_the_record_as_it_was():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, cache, [10, 11, 12, 13, 14, 15], label=0)
    cache.count_skipped(3, label=4)
    before = cache.held_tokens()
    checkpoint = CacheSnapshot.take(cache)
    decode(model, cache, 60, label=5)  # evicts 12, labelled 0
    assert cache.held_tokens().last_forgotten_label == 0
    checkpoint.restore(cache)
    assert cache.held_tokens() == before


def test_a_reply_snapshot_brings_back_the_tokens_a_long_reply_overwrote():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, cache, [10, 11, 12, 13, 14], label=0)
    before = cache.held_tokens()
    snapshot = CacheSnapshot.take(cache, reach=9)
    for token in range(70, 79):  # every window slot written, several times over
        decode(model, cache, token, label=1)
    assert cache.held_tokens().window_ids == (75, 76, 77, 78)
    snapshot.restore(cache)
    assert cache.held_tokens() == before
    snapshot.restore(cache)  # a snapshot serves more than one /regen
    assert cache.held_tokens() == before


def test_a_batch_member_records_what_a_one_row_pass_records():
    model = tiny_model("llama")
    alone, member, other = (SinkCache.for_model(model, SINKS, WINDOW) for _ in range(3))
    for cache in (alone, member):
        feed(model, cache, [10, 11, 12, 13, 14, 15], label=0)  # full: each pass evicts one
    feed(model, other, [90, 91, 92], label=0)
    evictions = [decode(model, alone, token, label=1) for token in (40, 41, 42)]
    batch = CacheBatch()
    batch.join(member)
    batch.join(other)
    batched = []
    for token in (40, 41, 42):
        tokens = [torch.tensor([token]), torch.tensor([token + 50])]
        with batch.decode_pass(tokens, labels=[1, 6], token_ids=[token, token + 50]) as opened:
            model_logits(model, batch, opened.input_ids, opened.inputs)
        batched.append(opened.evictions[0])
    assert member.held_tokens() == alone.held_tokens()
    assert [eviction.token_ids for eviction in batched] == [eviction.token_ids for eviction in evictions]
    assert [eviction.token_ids for eviction in evictions] == [(12,), (13,), (14,)]
    assert other.held_tokens().window_ids == (92, 90, 91, 92)  # its own tokens, 40 + 50 and on
    assert other.held_tokens().window_labels == (0, 6, 6, 6)


def test_a_reset_forgets_the_record():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, cache, [10, 11, 12, 13, 14, 15], label=0)
    feed(model, cache, [16], label=0)
    cache.count_skipped(2, label=0)
    cache.reset()
    assert cache.held_tokens() == HeldTokens((), (), (), (), 0, NO_LABEL)


def test_held_tokens_put_back_must_fit_the_ledger():
    model = tiny_model("llama")
    cache = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, cache, [10, 11, 12, 13, 14, 15], label=0)
    feed(model, cache, [16], label=0)
    held = cache.held_tokens()
    other = SinkCache.for_model(model, SINKS, WINDOW)
    feed(model, other, [20, 21, 22, 23, 24, 25], label=3)
    feed(model, other, [26], label=3)
    other.restore_held(HeldTokens(held.sink_ids, held.sink_labels, held.window_ids, (5, 5, 6, 6), 9, 2))
    assert other.held_tokens() == HeldTokens(held.sink_ids, held.sink_labels, held.window_ids, (5, 5, 6, 6), 9, 2)
    assert other.ledger.skipped == 9 - 1
    with pytest.raises(CacheStateError, match="its tokens and its cache disagree"):
        other.restore_held(HeldTokens(held.sink_ids, held.sink_labels, held.window_ids[1:], (5, 6, 6), 9, 2))
    with pytest.raises(CacheStateError, match="forgot fewer tokens than evicted"):
        other.restore_held(HeldTokens(held.sink_ids, held.sink_labels, held.window_ids, (5, 5, 6, 6), 0, 2))
