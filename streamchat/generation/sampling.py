"""Choosing the next token from the model's logits, on the logits' device.

The steps follow transformers' generate(), in its order: repetition penalty on the
raw logits, then OpenAI's frequency and presence penalties (which transformers lacks;
after the repetition penalty, as vLLM applies them), then temperature, top-k, top-p and
min-p, then a draw from what is left. Temperature 0 is greedy decoding: the penalties
still apply, then argmax.

The penalties count different tokens. The repetition penalty marks every token the
cache holds (the prompt and earlier turns included), each once. The frequency and
presence penalties count only the tokens drawn so far in the current reply, as OpenAI
and vLLM define them: logits[j] -= c[j] * frequency_penalty + (c[j] > 0) * presence_penalty,
where c[j] is how many times token j was drawn before this position of the reply.

make_draw composes the draw once from a reply's settings (mlx-lm's make_sampler), so
a step runs only the cuts that are on. A draw avoids a full sort of the vocabulary
where it can: the cuts only ever keep a prefix of the tokens ranked by logit, so they
can run on the few highest (`torch.topk`) when those provably hold everything the cuts
keep. Whether they do is a device flag read back with the token; when they did not,
TokenDraw.settle redraws over the whole vocabulary with the same uniform number, so a
seed gives the same tokens either way. A draw is the inverse of the kept tokens'
cumulative distribution at one seeded uniform number. The cuts' reference, in the
exact semantics of transformers' logits processors, is tests/support/reference_sampling.py.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass

import torch

from streamchat.errors import CacheStateError
from streamchat.generation.settings import MAX_SEED, GenerationSettings

# How many of the highest logits a draw looks at before it falls back to the whole vocabulary.
SHORTLIST = 128

# Logits [n] ranked highest first, and the log normaliser of the whole distribution when
# they are only its head (None when they are the whole vocabulary), to the logits a cut keeps.
_Cut = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def penalize_held(logits: torch.Tensor, token_ids: torch.Tensor, held: torch.Tensor, penalty: float) -> torch.Tensor:
    """The repetition penalty over the tokens `held` [n] marks among `token_ids` [n]: fixed shapes, no host sync.

    Positive logits are divided by the penalty, negative ones multiplied (transformers'
    RepetitionPenaltyLogitsProcessor), each token once however often it is held.
    """
    counts = torch.zeros(logits.shape[-1], device=logits.device).scatter_add_(0, token_ids, held.float())
    penalized = torch.where(logits < 0, logits * penalty, logits / penalty)
    return torch.where(counts > 0, penalized, logits)


def penalize_counts(logits: torch.Tensor, counts: torch.Tensor, frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's frequency and presence penalties for `counts` [vocab], how often each token was drawn in the reply.

    logits - (counts * frequency + (counts > 0) * presence): fixed shapes, no host sync.
    """
    return logits - (counts * frequency + (counts > 0).to(counts.dtype) * presence)


@dataclass(frozen=True)
class Draw:
    """A token drawn on the device: token [1]; `settled` [1] is False when the shortlist could not decide."""

    token: torch.Tensor
    settled: torch.Tensor
    uniform: torch.Tensor | None  # the number it was drawn at, to redraw over the whole vocabulary


@dataclass(frozen=True)
class Settled:
    """A draw decided on the host: the token id, the same token on the device to feed, and whether it was redrawn."""

    token: int
    on_device: torch.Tensor  # [1]
    redrawn: bool  # the shortlist could not decide: drawn again over the whole vocabulary


class Sampler:
    """The seeded generator draws take their uniform numbers from, so a seed replays a conversation."""

    def __init__(self, seed: int | None = None) -> None:
        # Without a seed, pick one anyway and keep it, so it can be shown and reused.
        # Not from torch's global generator, which a library may have seeded.
        self.seed = seed if seed is not None else secrets.randbelow(MAX_SEED + 1)
        self._generator: torch.Generator | None = None

    def uniform(self, device: torch.device) -> torch.Tensor:
        """The next uniform number [1] in [0, 1), drawn on `device`."""
        return torch.rand(1, generator=self._generator_for(device), device=device)

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


class TokenDraw:
    """One reply's draw, composed by make_draw: called on logits on the device, then settled on the host."""

    def __init__(
        self,
        draw: Callable[[torch.Tensor], Draw],
        redraw: Callable[[torch.Tensor, torch.Tensor], Draw],
    ) -> None:
        self._draw = draw  # on the shortlist where it can decide
        self._redraw = redraw  # the same logits at an earlier draw's number, over the whole vocabulary

    def __call__(self, logits: torch.Tensor) -> Draw:
        """The next token from one position's logits [vocab] (the penalties already applied)."""
        return self._draw(logits)

    def settle(self, logits: torch.Tensor, drawn: Draw, read: tuple[int, bool]) -> Settled:
        """The token `drawn` from `logits` stands when its shortlist decided; else it is drawn again at its number.

        `read` is its token and settled flag, read back to the host.
        """
        token, settled = read
        if settled:
            return Settled(token, drawn.token, redrawn=False)
        if drawn.uniform is None:  # only a shortlist leaves a draw unsettled, and it draws at a number
            raise CacheStateError("a draw made without a number cannot be drawn again")
        redrawn = self._redraw(logits, drawn.uniform).token
        return Settled(int(redrawn.item()), redrawn, redrawn=True)

    def next_token(self, logits: torch.Tensor) -> int:
        """The next token id from one position's logits [vocab], read back to the host."""
        drawn = self(logits)
        token, settled = torch.cat((drawn.token, drawn.settled.long())).tolist()
        return self.settle(logits, drawn, (token, bool(settled))).token


def make_draw(settings: GenerationSettings, sampler: Sampler) -> TokenDraw:
    """The draw these settings make, composed once; its uniform numbers come from `sampler`."""
    if settings.greedy:
        return TokenDraw(_argmax, lambda logits, uniform: _argmax(logits))
    temperature = settings.temperature
    if not (settings.top_k > 0 or settings.top_p < 1 or settings.min_p > 0):
        # Nothing is cut: no ranking needed at all.
        def unranked(logits: torch.Tensor, uniform: torch.Tensor) -> Draw:
            probs = (logits.float() / temperature).softmax(dim=-1)
            return Draw(_inverse_cdf(probs, uniform), _settled(logits), uniform)

        return TokenDraw(lambda logits: unranked(logits, sampler.uniform(logits.device)), unranked)

    cut = _make_cut(settings)
    settles = _make_settles(settings)
    size = settings.top_k if settings.top_k > 0 else SHORTLIST

    def whole(logits: torch.Tensor, uniform: torch.Tensor) -> Draw:
        values, order = torch.sort(logits.float() / temperature, descending=True)
        return Draw(order.gather(-1, _inverse_cdf(cut(values, None), uniform)), _settled(logits), uniform)

    def shortlisted(logits: torch.Tensor) -> Draw:
        uniform = sampler.uniform(logits.device)
        if size >= logits.shape[-1]:
            return whole(logits, uniform)
        scaled = logits.float() / temperature
        values, order = torch.topk(scaled, size + 1)  # the shortlist and the next logit down
        log_total = torch.logsumexp(scaled, dim=-1, keepdim=True)
        index = _inverse_cdf(cut(values[:-1], log_total), uniform)
        return Draw(order.gather(-1, index), settles(values, log_total), uniform)

    return TokenDraw(shortlisted, whole)


def _make_cut(settings: GenerationSettings) -> _Cut:
    """The cuts that are on, as one function from ranked logits to the probabilities [n] they keep."""
    cuts: list[_Cut] = []
    if settings.top_k > 0:
        top_k = settings.top_k
        cuts.append(lambda kept, log_total: kept.masked_fill(kept < kept[min(top_k, kept.shape[-1]) - 1], -torch.inf))
    if settings.top_p < 1:
        top_p, after_top_k = settings.top_p, settings.top_k > 0

        def cut_top_p(kept: torch.Tensor, log_total: torch.Tensor | None) -> torch.Tensor:
            # After top-k, top-p measures mass among the top k, not the whole vocabulary.
            total = torch.logsumexp(kept, dim=-1) if log_total is None or after_top_k else log_total
            probs = (kept - total).exp()
            return kept.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, -torch.inf)

        cuts.append(cut_top_p)
    if settings.min_p > 0:
        # min-p compares each probability with the top one's: a difference of logits.
        log_min_p = math.log(settings.min_p)
        cuts.append(lambda kept, log_total: kept.masked_fill(kept < kept[:1] + log_min_p, -torch.inf))

    def cut(ranked: torch.Tensor, log_total: torch.Tensor | None) -> torch.Tensor:
        for each in cuts:
            ranked = each(ranked, log_total)
        return ranked.softmax(dim=-1)

    return cut


def _make_settles(settings: GenerationSettings) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """Whether the cuts keep nothing below a shortlist: from `values` [size + 1], the shortlist
    and the next logit down, and the whole log normaliser [1], a flag [1] on the device."""
    if settings.top_k > 0:
        # top-k also keeps ties with the k-th logit.
        return lambda values, log_total: values[-2:-1] > values[-1:]
    if settings.top_p < 1:
        log_top_p = math.log(settings.top_p)
        return lambda values, log_total: torch.logsumexp(values[:-1], dim=-1, keepdim=True) - log_total >= log_top_p
    log_min_p = math.log(settings.min_p)
    return lambda values, log_total: values[-1:] < values[:1] + log_min_p


def _argmax(logits: torch.Tensor) -> Draw:
    return Draw(logits.argmax(dim=-1, keepdim=True), _settled(logits), None)


def _settled(logits: torch.Tensor) -> torch.Tensor:
    return torch.ones(1, dtype=torch.bool, device=logits.device)


def _inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The index [1] where the cumulative probabilities first pass uniform in [0, 1)."""
    cumulative = probs.cumsum(dim=-1)
    index = torch.searchsorted(cumulative, uniform * cumulative[-1:], right=True)
    return index.clamp_(max=probs.shape[-1] - 1)
