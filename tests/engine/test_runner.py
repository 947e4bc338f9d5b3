"""One step's rows and chunks in one forward pass give what each gives read alone (float32), and the caches
hold the same: through the lean ragged pass (fused llama-family models) and the model's own forward (others)."""

from __future__ import annotations

import copy

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.batch import CacheBatch
from streamchat.cache.feeding import model_logits
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.engine.runner import Runner
from streamchat.engine.scheduler import Scheduled
from streamchat.engine.work import DecodeRow, PromptChunk, Ticket
from streamchat.placement.fusion import fuse_projections
from tests.support.models import VOCAB, tiny_model

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
