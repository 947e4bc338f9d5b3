"""Choosing the next token from the model's logits.

The steps follow transformers' generate(), in its order: repetition penalty on the
raw logits, then temperature, top-k, top-p and min-p, then a draw from what is left.
Temperature 0 is greedy decoding: the repetition penalty still applies, then argmax.
Each step is a pure function on a logits vector (any leading dimensions); Sampler
only adds the seeded random generator, so the same seed, settings and logits give
the same tokens.
"""

from __future__ import annotations

import secrets

import torch

from streamchat.engine.settings import MAX_SEED, GenerationSettings


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make tokens already seen less likely: positive logits divided by the penalty,
    negative ones multiplied (transformers' RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0 or previous_ids.numel() == 0:
        return logits
    seen = logits.gather(-1, previous_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, previous_ids, seen)


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
    sorted_probs = sorted_logits.softmax(dim=-1)
    # A token stays if the tokens ranked above it fall short of top_p; the top one always does.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p
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


class Sampler:
    """Draws next tokens with its own seeded generator, so a seed replays a conversation."""

    def __init__(self, seed: int | None = None) -> None:
        # Without a seed, pick one anyway and keep it, so it can be shown and reused.
        # Not from torch's global generator, which a library may have seeded.
        self.seed = seed if seed is not None else secrets.randbelow(MAX_SEED + 1)
        self._generator: torch.Generator | None = None

    def next_token(
        self, logits: torch.Tensor, settings: GenerationSettings, previous_ids: torch.Tensor | None = None
    ) -> int:
        """The next token id from one position's logits (shape: vocab)."""
        if previous_ids is not None:
            logits = apply_repetition_penalty(logits, previous_ids, settings.repetition_penalty)
        if settings.greedy:
            return int(logits.argmax(dim=-1).item())
        probs = next_token_probs(logits, settings)
        if self._generator is None:
            # On the device the logits live on, so drawing needs no copy.
            self._generator = torch.Generator(device=probs.device).manual_seed(self.seed)
        return int(torch.multinomial(probs, num_samples=1, generator=self._generator).item())
