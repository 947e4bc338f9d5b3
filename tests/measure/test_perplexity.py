"""The per-token NLL of each policy, on a tiny model: where two policies must agree, they agree exactly."""

import torch

from streamchat.measure.perplexity import dense_nll, recompute_nll, streaming_nll
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
