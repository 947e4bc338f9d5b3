"""Choosing the next token from the model's logits, on the logits' device.

The steps follow transformers' generate(), in its order: repetition penalty on the
raw logits, then temperature, top-k, top-p and min-p, then a draw from what is left.
Temperature 0 is greedy decoding: the repetition penalty still applies, then argmax.

The cut functions below are the reference: pure, on a logits vector, in the exact
semantics of transformers' logits processors. A draw avoids their full sort of the
vocabulary where it can: the cuts only ever keep a prefix of the tokens ranked by
logit, so they can run on the few highest (`torch.topk`) when those provably hold
everything the cuts keep. Whether they do is a device flag read back with the token;
when they did not, the draw is redone over the whole vocabulary with the same
uniform number, so a seed gives the same tokens either way. A draw is the inverse of
the kept tokens' cumulative distribution at one seeded uniform number.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

import torch

from streamchat.generation.settings import MAX_SEED, GenerationSettings

# How many of the highest logits a draw looks at before it falls back to the whole vocabulary.
SHORTLIST = 128


def apply_repetition_penalty(logits: torch.Tensor, previous_ids: torch.Tensor, penalty: float) -> torch.Tensor:
    """Make tokens already seen less likely: positive logits divided by the penalty,
    negative ones multiplied (transformers' RepetitionPenaltyLogitsProcessor)."""
    if penalty == 1.0 or previous_ids.numel() == 0:
        return logits
    seen = logits.gather(-1, previous_ids)
    seen = torch.where(seen < 0, seen * penalty, seen / penalty)
    return logits.scatter(-1, previous_ids, seen)


def penalize_held(logits: torch.Tensor, token_ids: torch.Tensor, held: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty over the tokens `held` [n] marks among `token_ids` [n]: fixed shapes, no host sync."""
    counts = torch.zeros(logits.shape[-1], device=logits.device).scatter_add_(0, token_ids, held.float())
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(counts > 0, penalized, logits)


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


@dataclass(frozen=True)
class Draw:
    """A token drawn on the device: token [1]; `settled` [1] is False when the shortlist could not decide."""

    token: torch.Tensor
    settled: torch.Tensor
    uniform: torch.Tensor | None  # the number it was drawn at, to redraw over the whole vocabulary


class Sampler:
    """Draws next tokens with its own seeded generator, so a seed replays a conversation."""

    def __init__(self, seed: int | None = None) -> None:
        # Without a seed, pick one anyway and keep it, so it can be shown and reused.
        # Not from torch's global generator, which a library may have seeded.
        self.seed = seed if seed is not None else secrets.randbelow(MAX_SEED + 1)
        self._generator: torch.Generator | None = None

    def draw(
        self,
        logits: torch.Tensor,
        settings: GenerationSettings,
        uniform: torch.Tensor | None = None,
        shortlist: bool = True,
    ) -> Draw:
        """The next token from one position's logits [vocab] (repetition penalty already applied).

        `uniform` redraws at an earlier draw's number; `shortlist=False` ranks the whole vocabulary.
        """
        settled = torch.ones(1, dtype=torch.bool, device=logits.device)
        if settings.greedy:
            return Draw(logits.argmax(dim=-1, keepdim=True), settled, None)
        if uniform is None:
            uniform = torch.rand(1, generator=self._generator_for(logits.device), device=logits.device)
        scaled = logits.float() / settings.temperature
        vocab = scaled.shape[-1]
        if not (settings.top_k > 0 or settings.top_p < 1 or settings.min_p > 0):
            # Nothing is cut: no ranking needed at all.
            return Draw(_inverse_cdf(scaled.softmax(dim=-1), uniform), settled, uniform)
        size = settings.top_k if settings.top_k > 0 else SHORTLIST
        if shortlist and size < vocab:
            values, order = torch.topk(scaled, size + 1)
            log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)
            settled = _shortlist_settles(values, settings, log_total)
            probs = _cut(values[:-1], settings, log_total)
        else:
            values, order = torch.sort(scaled, descending=True)
            probs = _cut(values, settings)
        return Draw(order.gather(-1, _inverse_cdf(probs, uniform)), settled, uniform)

    def next_token(
        self, logits: torch.Tensor, settings: GenerationSettings, previous_ids: torch.Tensor | None = None
    ) -> int:
        """The next token id from one position's logits (shape: vocab), read back to the host."""
        if previous_ids is not None:
            logits = apply_repetition_penalty(logits, previous_ids, settings.repetition_penalty)
        drawn = self.draw(logits, settings)
        token, settled = torch.cat((drawn.token, drawn.settled.long())).tolist()
        if not settled:
            token = int(self.draw(logits, settings, drawn.uniform, shortlist=False).token.item())
        return token

    def random_state(self) -> torch.Tensor | None:
        """Where the generator stands (a byte tensor), None before the first draw: it starts from the seed."""
        return None if self._generator is None else self._generator.get_state()

    def set_random_state(self, state: torch.Tensor, device: torch.device) -> None:
        """Stand where random_state() stood, on `device` (the one the logits will live on)."""
        self._generator_for(device).set_state(state)

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._generator is None:
            # On the device the logits live on, so drawing needs no copy.
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator


def _cut(ranked: torch.Tensor, settings: GenerationSettings, log_total: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities [n] the cuts keep of logits [n] ranked highest first.

    `log_total` is the log normaliser of the whole distribution when `ranked` is only its
    head (top-p measures mass against it); None when `ranked` is the whole vocabulary.
    """
    kept = ranked
    if settings.top_k > 0:
        kept = kept.masked_fill(kept < kept[min(settings.top_k, kept.shape[-1]) - 1], -torch.inf)
        log_total = None  # top-p then measures mass among the top k
    if settings.top_p < 1:
        probs = (kept - (torch.logsumexp(kept, dim=-1) if log_total is None else log_total)).exp()
        kept = kept.masked_fill(probs.cumsum(dim=-1) - probs >= settings.top_p, -torch.inf)
    if settings.min_p > 0:
        # min-p compares each probability with the top one's: a difference of logits.
        kept = kept.masked_fill(kept < kept[:1] + math.log(settings.min_p), -torch.inf)
    return kept.softmax(dim=-1)


def _shortlist_settles(values: torch.Tensor, settings: GenerationSettings, log_total: torch.Tensor) -> torch.Tensor:
    """[1] bool: the cuts keep nothing below the shortlist `values[:-1]` (`values[-1]` is the next logit down)."""
    head, below = values[:-1], values[-1:]
    if settings.top_k > 0:
        return head[-1:] > below  # top-k also keeps ties with the k-th logit
    if settings.top_p < 1:
        return torch.logsumexp(head, dim=-1, keepdim=True) - log_total >= math.log(settings.top_p)
    return below < head[:1] + math.log(settings.min_p)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index [1] where the cumulative probabilities first pass uniform in [0, 1)."""
    cumulative = probs.cumsum(dim=-1)
    index = torch.searchsorted(cumulative, uniform * cumulative[-1:], right=True)
    return index.clamp_(max=probs.shape[-1] - 1)
