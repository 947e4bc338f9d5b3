"""The sampling reference, for tests only: pure functions on a logits vector, in the exact
semantics of transformers' logits processors, with a full sort of the vocabulary.

streamchat.generation.sampling draws from what these keep, on a shortlist where it can;
they share no code with it.
"""

from __future__ import annotations

import torch

from streamchat.generation.settings import GenerationSettings


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make tokens already seen less likely: positive logits divided by the penalty,
    negative ones multiplied (transformers' RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0 or previous_ids.numel() == 0:
        return logits
    seen = logits.gather(-1, previous_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, previous_ids, seen)


def apply_openai_penalties(
    logits: torch.Tensor, reply_ids: list[int], frequency_penalty: float, presence_penalty: float
) -> torch.Tensor:
    """OpenAI's frequency and presence penalties, token by token over the ids the reply drew so far:
    each drawn token's logit less its count times frequency_penalty, plus presence_penalty once."""
    penalized = logits.clone()
    for token in set(reply_ids):
        penalized[token] -= reply_ids.count(token) * frequency_penalty + presence_penalty
    return penalized


def mask_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k highest logits (and any tied with the k-th); 0 keeps all."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    pivot = torch.topk(logits, k).values[..., -1:]
    return logits.masked_fill(logits < pivot, -torch.inf)


def mask_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the fewest most likely tokens whose probabilities sum to at least top_p."""
    if top_p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, descending=True)
    drop_sorted = _drop_past_top_p(sorted_logits, top_p)
    drop = drop_sorted.scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, -torch.inf)


def mask_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens less likely than min_p times the most likely one."""
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -torch.inf)


def next_token_probs(logits: torch.Tensor, settings: GenerationSettings) -> torch.Tensor:
    """The distribution a token is drawn from (temperature above 0): temperature, then the
    top-k, top-p and min-p cuts."""
    logits = logits.float() / settings.temperature
    logits = mask_top_k(logits, settings.top_k)
    logits = mask_top_p(logits, settings.top_p)
    logits = mask_min_p(logits, settings.min_p)
    return logits.softmax(dim=-1)


def _drop_past_top_p(sorted_logits: torch.Tensor, top_p: float) -> torch.Tensor:
    # A token stays if the tokens ranked above it fall short of top_p; the top one always does.
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    return mass_before >= top_p
