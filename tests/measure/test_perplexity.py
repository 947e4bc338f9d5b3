"""The per-token NLL of each policy, on a tiny model: where two policies must agree, they agree exactly."""

import pytest
import torch

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot
from streamchat.errors import ConfigError
from streamchat.measure.perplexity import answer_log_prob, dense_nll, recompute_nll, streaming_nll
from tests.support.models import VOCAB, tiny_model

TOKENS = 96


def text_ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(VOCAB, (1, TOKENS), generator=torch.Generator().manual_seed(seed))


def test_dense_is_the_same_at_any_chunk_size():
    model, ids = tiny_model(), text_ids()
    one_pass = dense_nll(model, ids, chunk=TOKENS)
    assert one_pass.shape == (TOKENS - 1,) and one_pass.dtype == torch.float64
    torch.testing.assert_close(dense_nll(model, ids, chunk=7), one_pass, atol=1e-5, rtol=1e-5)


def test_every_policy_equals_dense_while_nothing_leaves_the_cache():
    model, ids = tiny_model(), text_ids()
    dense = dense_nll(model, ids, chunk=TOKENS)
    torch.testing.assert_close(streaming_nll(model, ids, sinks=4, window=TOKENS, chunk=16), dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(recompute_nll(model, ids, window=TOKENS, chunk=16), dense, atol=1e-5, rtol=1e-5)


def test_recompute_per_token_reads_exactly_the_last_window_tokens():
    model, ids, window = tiny_model(), text_ids(), 20
    nll = recompute_nll(model, ids, window=window, chunk=1)
    for token in (1, 20, 21, 60, TOKENS - 1):
        context = ids[:, max(0, token - window) : token]
        with torch.inference_mode():
            logits = model(input_ids=context, use_cache=False).logits[0, -1].double()
        expected = -torch.log_softmax(logits, dim=-1)[ids[0, token]]
        torch.testing.assert_close(nll[token - 1], expected, atol=1e-5, rtol=1e-5)


def test_chunked_recompute_keeps_the_window_streaming_keeps():
    """With chunk c, both policies predict each token from window - c + 1 .. window tokens: they differ, a little."""
    model, ids = tiny_model(), text_ids()
    exact = recompute_nll(model, ids, window=32, chunk=1)
    chunked = recompute_nll(model, ids, window=32, chunk=8)
    torch.testing.assert_close(chunked[:32], exact[:32], atol=1e-5, rtol=1e-5)  # the window is not full yet
    assert not torch.allclose(chunked[40:], exact[40:])


def test_progress_hears_every_scored_token():
    model, ids = tiny_model(), text_ids()
    for score in (
        lambda on_scored: dense_nll(model, ids, 40, on_scored),
        lambda on_scored: streaming_nll(model, ids, 4, 28, 16, on_scored),
        lambda on_scored: recompute_nll(model, ids, 32, 16, on_scored),
    ):
        counts: list[int] = []
        score(counts.append)
        assert sum(counts) == TOKENS - 1 and len(counts) > 1


def test_an_answer_s_log_prob_is_its_mean_nll_after_the_question_and_the_cache_is_taken_back():
    model, ids = tiny_model(), text_ids(3)[0].tolist()
    context, question, answer = ids[:40], ids[40:50], ids[50:58]
    cache = SinkCache.for_model(model, 4, 60)
    forward(model, cache, torch.tensor([context]))
    before, stats = CacheSnapshot.whole(cache).tensors(), cache.stats()
    scored = answer_log_prob(model, cache, question, answer, torch.device("cpu"))
    # Nothing was evicted yet: the same as the whole text read densely.
    expected = -dense_nll(model, torch.tensor([context + question + answer]), chunk=58)[-len(answer) :].mean().item()
    assert scored == pytest.approx(expected, abs=1e-5)
    after = CacheSnapshot.whole(cache).tensors()
    assert cache.stats() == stats and all(torch.equal(before[name], after[name]) for name in before)
    with pytest.raises(ConfigError, match="raise --window"):
        answer_log_prob(model, cache, ids[:40], ids[40:80], torch.device("cpu"))
