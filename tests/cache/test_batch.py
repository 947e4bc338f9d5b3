"""CacheBatch: the members' storage is a view of a pooled row while they are in it, their own again after."""

from __future__ import annotations

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.batch import CacheBatch, bucket
from streamchat.cache.feeding import model_logits
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.errors import CacheStateError
from tests.support.models import VOCAB, tiny_model


def filled(model, sinks: int, tokens: int, seed: int) -> SinkCache:
    cache = SinkCache.for_model(model, sinks, 24)
    forward(model, cache, torch.randint(3, VOCAB, (1, tokens), generator=torch.Generator().manual_seed(seed)))
    return cache


def decode(model, batch: CacheBatch, tokens: list[int]) -> torch.Tensor:
    with batch.decode_pass([torch.tensor([token]) for token in tokens]) as opened:
        return model_logits(model, batch, opened.input_ids, opened.inputs)


def test_buckets_are_powers_of_two():
    assert [bucket(count) for count in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_members_view_their_rows_and_leaving_gives_each_its_own_storage_back():
    model = tiny_model("llama")
    caches = [filled(model, sinks, tokens, seed) for seed, (sinks, tokens) in enumerate([(4, 10), (6, 20), (2, 7)])]
    before = [CacheSnapshot.whole(cache).tensors() for cache in caches]
    batch = CacheBatch()
    for cache in caches:
        batch.join(cache)
    for row, cache in enumerate(caches):
        layer = cache.layers[0]
        assert layer.keys.data_ptr() == batch._slot_pools[0][0][row].data_ptr()
        assert layer.keys.shape[2] == cache.ledger.slots  # a narrower member views the first columns
    for cache, state in zip(caches, before, strict=True):  # joining moved nothing
        for name, tensor in CacheSnapshot.whole(cache).tensors().items():
            assert torch.equal(tensor, state[name]), name
    batch.leave(caches[0])  # the last member takes the first row
    assert batch.members == [caches[2], caches[1]]
    assert caches[2].layers[0].keys.data_ptr() == batch._slot_pools[0][0][0].data_ptr()
    assert caches[0].layers[0].keys.is_contiguous() and caches[0].layers[0].keys._base is None
    for cache, state in zip(caches, before, strict=True):
        for name, tensor in CacheSnapshot.whole(cache).tensors().items():
            assert torch.equal(tensor, state[name]), name


def test_caches_joining_together_take_the_next_rows_in_order():
    model = tiny_model("llama")
    caches = [filled(model, sinks, tokens, seed) for seed, (sinks, tokens) in enumerate([(4, 10), (6, 20), (2, 7)])]
    before = [CacheSnapshot.whole(cache).tensors() for cache in caches]
    batch = CacheBatch()
    batch.join(caches[0])
    batch.join(caches[1], caches[2], caches[1], caches[0])  # repeats and members are skipped
    assert batch.members == caches
    assert batch._slot_pools[0][0].shape[0] == bucket(3)
    for row, cache in enumerate(caches):
        assert cache.layers[0].keys.data_ptr() == batch._slot_pools[0][0][row].data_ptr()
    for cache, state in zip(caches, before, strict=True):
        for name, tensor in CacheSnapshot.whole(cache).tensors().items():
            assert torch.equal(tensor, state[name]), name


def test_a_batched_pass_gives_each_row_the_logits_of_its_own_pass():
    model = tiny_model("qwen2")
    alone = [filled(model, sinks, tokens, seed) for seed, (sinks, tokens) in enumerate([(4, 28), (3, 12)])]
    together = [filled(model, sinks, tokens, seed) for seed, (sinks, tokens) in enumerate([(4, 28), (3, 12)])]
    expected = []
    for cache, token in zip(alone, (17, 99), strict=True):
        with cache.decode_pass():
            inputs = cache.decode_inputs(torch.tensor([[token]]))
            expected.append(
                model(
                    input_ids=torch.tensor([[token]]),
                    cache=cache,
                    position_ids=inputs.position_ids,
                    attention_mask=inputs.attention_mask,
                    logits_to_keep=1,
                ).logits
            )
    batch = CacheBatch()
    for cache in together:
        batch.join(cache)
    logits = decode(model, batch, [17, 99])
    for row, wanted in enumerate(expected):
        torch.testing.assert_close(logits[row : row + 1], wanted, rtol=0, atol=1e-5)
    for one, other in zip(alone, together, strict=True):
        assert one.stats() == other.stats()  # the first evicted a token, both moved their sinks on


def test_a_row_an_earlier_member_wrote_further_is_taken_over_as_if_it_were_new():
    model = tiny_model("llama")
    other, earlier = filled(model, 4, 9, 0), filled(model, 4, 20, 1)
    joining, alone = filled(model, 4, 6, 2), filled(model, 4, 6, 2)
    batch = CacheBatch()
    batch.join(other, earlier)
    batch.leave(earlier)  # row 1 keeps what `earlier` wrote, 20 slots
    batch.join(joining)  # only its 6 written slots are copied in: the rest of row 1 is earlier's
    assert batch._slot_pools[0][0][1, :, 6:20].abs().sum() > 0
    logits = decode(model, batch, [7, 8])  # attention reads 10 slots of every row: 4 of them earlier's, in row 1
    with alone.decode_pass():
        inputs = alone.decode_inputs(torch.tensor([[8]]))
        wanted = model(
            input_ids=torch.tensor([[8]]),
            cache=alone,
            position_ids=inputs.position_ids,
            attention_mask=inputs.attention_mask,
            logits_to_keep=1,
        ).logits
    torch.testing.assert_close(logits[1:2], wanted, rtol=0, atol=1e-5)
    batch.leave(joining)  # it owns its storage again: what it wrote, then zeros, as a cache never batched
    for mine, never in zip(joining.layers, alone.layers, strict=True):
        assert not mine.keys[:, :, 7:].any() and not mine.values[:, :, 7:].any()
        torch.testing.assert_close(mine.keys, never.keys, rtol=0, atol=1e-5)
    assert joining.stats() == alone.stats()


def test_a_pass_needs_a_token_for_every_member_and_a_member_its_sinks_filled():
    model = tiny_model("llama")
    batch = CacheBatch()
    with pytest.raises(CacheStateError, match="sinks are filled"):
        batch.join(filled(model, 8, 3, 0))
    batch.join(filled(model, 4, 10, 1))
    with pytest.raises(CacheStateError, match="got 2 tokens"):
        decode(model, batch, [1, 2])
