"""Per-token negative log-likelihood of a long text under each caching policy (the paper's Figure 3).

Every policy returns the NLL of tokens 1..n-1 (token 0 has no context), as a float64
tensor, so running and final perplexities compare token for token. `on_scored`, if
given, hears how many more tokens each forward pass scored (for a progress bar).

answer_log_prob() scores one answer the same way, teacher-forced after a question, in a
cache that is taken back after it (the keep and recall benchmarks' probe).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from streamchat.cache import SinkCache, forward
from streamchat.cache.snapshots import CacheSnapshot, release_snapshots
from streamchat.errors import ConfigError

OnScored = Callable[[int], None]


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL [n] of targets [n] under logits [n, vocab]."""
    log_probs = torch.log_softmax(logits.double(), dim=-1)
    return -log_probs.gather(1, targets[:, None])[:, 0]


def _ignore(count: int) -> None:
    pass


class _Collector:
    """Scores chunks fed in order: a chunk's first token is predicted by the previous chunk's last logits."""

    def __init__(self, on_scored: OnScored) -> None:
        self.pieces: list[torch.Tensor] = []
        self.previous: torch.Tensor | None = None
        self.on_scored = on_scored

    def add(self, chunk_ids: torch.Tensor, logits: torch.Tensor) -> None:
        """chunk_ids [n] and their logits [n, vocab]."""
        if self.previous is None:
            self.pieces.append(_nll(logits[:-1], chunk_ids[1:]))
        else:
            self.pieces.append(_nll(torch.cat((self.previous, logits[:-1])), chunk_ids))
        self.previous = logits[-1:]
        self.on_scored(self.pieces[-1].shape[0])

    def result(self) -> torch.Tensor:
        return torch.cat(self.pieces)


def streaming_nll(
    model: Any, ids: torch.Tensor, sinks: int, window: int, chunk: int, on_scored: OnScored = _ignore
) -> torch.Tensor:
    """StreamingLLM: `sinks` + `window` through the sink cache, fed `chunk` tokens (at most `window`) at a time,
    every position's logits scored: through the model's own forward, as the runner keeps only the last position's.

    sinks=0 is window attention (positions still assigned within the cache). Each chunk
    first evicts what it needs, so once the cache is full a token is predicted from
    between sinks + window - chunk + 1 and sinks + window tokens.
    """
    cache, collector = SinkCache.for_model(model, sinks, window), _Collector(on_scored)
    with torch.inference_mode():
        for start in range(0, ids.shape[-1], chunk):
            chunk_ids = ids[:, start : start + chunk]
            collector.add(chunk_ids[0], forward(model, cache, chunk_ids, all_logits=True).logits[0])
    return collector.result()


def dense_nll(model: Any, ids: torch.Tensor, chunk: int, on_scored: OnScored = _ignore) -> torch.Tensor:
    """A full cache, positions growing with the text: the model's native behaviour.

    Exact at any chunk size (every token sees all earlier ones); `chunk` only trades
    memory for fewer copies of the growing cache.
    """
    cache, collector = DynamicCache(config=model.config), _Collector(on_scored)
    with torch.inference_mode():
        for start in range(0, ids.shape[-1], chunk):
            chunk_ids = ids[:, start : start + chunk]
            collector.add(chunk_ids[0], model(input_ids=chunk_ids, cache=cache, use_cache=True).logits[0])
    return collector.result()


def recompute_nll(
    model: Any, ids: torch.Tensor, window: int, chunk: int, on_scored: OnScored = _ignore
) -> torch.Tensor:
    """Sliding window with recomputation, the oracle: no cache, each chunk re-reads its last `window` tokens.

    Exact per token when chunk == 1. With chunk c, a token is predicted from between
    window - c + 1 and window tokens (an approximation that divides the cost by c):
    the same spread streaming_nll gives with sinks + window == `window` and the same chunk.
    """
    pieces = []
    with torch.inference_mode():
        for start in range(1, ids.shape[-1], chunk):
            stop = min(start + chunk, ids.shape[-1])
            context_start = max(0, stop - 1 - window)
            context = ids[:, context_start : stop - 1]
            count = stop - start
            # Only the last `count` positions predict tokens of this chunk.
            logits = model(input_ids=context, use_cache=False, logits_to_keep=count).logits[0]
            pieces.append(_nll(logits, ids[0, start:stop]))
            on_scored(count)
    return torch.cat(pieces)


def answer_log_prob(
    model: Any, cache: SinkCache, question: list[int], answer: list[int], device: torch.device
) -> float:
    """The answer's mean log-probability per token, teacher-forced after the question: both fed in one pass
    (refused past the window) and then taken back, so the cache is as it was."""
    ids = question + answer
    if len(ids) > cache.window:
        raise ConfigError(f"--window {cache.window}: the probe needs {len(ids)} tokens in one pass; raise --window")
    snapshot = CacheSnapshot.take(cache, reach=len(ids))
    logits = forward(model, cache, torch.tensor([ids], device=device), all_logits=True).logits[0]  # [len(ids), vocab]
    # The logits at position i predict token i + 1: those from the question's last token on predict the answer.
    predicting = logits[len(question) - 1 : len(ids) - 1].double().log_softmax(dim=-1)
    chosen = predicting.gather(1, torch.tensor(answer, device=predicting.device)[:, None])
    snapshot.restore(cache)
    release_snapshots(cache)
    return chosen.mean().item()
