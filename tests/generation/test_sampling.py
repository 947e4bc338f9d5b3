from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from streamchat.generation.sampling import SHORTLIST, Sampler, make_draw, penalize_counts, penalize_held
from streamchat.generation.settings import MAX_SEED, GenerationSettings
from tests.support.reference_sampling import (
    apply_openai_penalties,
    apply_repetition_penalty,
    mask_min_p,
    mask_top_k,
    mask_top_p,
    next_token_probs,
)

# Logits whose softmax is exactly these probabilities, up to float rounding.
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor(PROBS).log()
OFF = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0}
INF = math.inf


def settings(**changes: float) -> GenerationSettings:
    return GenerationSettings(**{**OFF, **changes})


def next_token(
    sampler: Sampler, logits: torch.Tensor, chosen: GenerationSettings, previous_ids: torch.Tensor | None = None
) -> int:
    """One token as the decoder draws it: the penalty over `previous_ids` (all held), then the draw."""
    if previous_ids is not None:
        held = torch.ones_like(previous_ids, dtype=torch.bool)
        logits = penalize_held(logits, previous_ids, held, chosen.repetition_penalty)
    return make_draw(chosen, sampler).next_token(logits)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    penalised = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), penalty=2.0)
    assert penalised.tolist() == [1.0, -2.0, 0.5, 3.0]  # a repeated id is penalised once
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0]  # the input is left alone


def test_repetition_penalty_of_one_or_without_history_changes_nothing() -> None:
    logits = torch.tensor([2.0, -1.0])
    assert apply_repetition_penalty(logits, torch.tensor([0, 1]), penalty=1.0).tolist() == [2.0, -1.0]
    assert apply_repetition_penalty(logits, torch.tensor([], dtype=torch.long), 2.0).tolist() == [2.0, -1.0]


def test_top_k_keeps_the_k_highest_and_ties_with_the_kth() -> None:
    assert mask_top_k(torch.tensor([1.0, 3.0, 2.0, 0.0]), 2).tolist() == [-INF, 3.0, 2.0, -INF]
    assert mask_top_k(torch.tensor([1.0, 3.0, 1.0, 0.0]), 2).tolist() == [1.0, 3.0, 1.0, -INF]
    assert mask_top_k(torch.tensor([1.0, 3.0]), 0).tolist() == [1.0, 3.0]
    assert mask_top_k(torch.tensor([1.0, 3.0]), 5).tolist() == [1.0, 3.0]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_fewest_tokens_reaching_p(top_p: float, kept: list[int]) -> None:
    masked = mask_top_p(LOGITS, top_p)
    assert torch.isfinite(masked).nonzero().flatten().tolist() == kept
    assert torch.equal(masked[kept], LOGITS[kept])


def test_top_p_works_on_unsorted_logits() -> None:
    shuffled = LOGITS[[2, 0, 3, 1]]  # probabilities 0.15, 0.5, 0.05, 0.3
    assert torch.isfinite(mask_top_p(shuffled, 0.75)).tolist() == [False, True, False, True]


@pytest.mark.parametrize(("min_p", "kept"), [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]), (0.35, [0, 1]), (1.0, [0])])
def test_min_p_masks_exactly_the_tokens_below_p_times_the_top_probability(min_p: float, kept: list[int]) -> None:
    # Thresholds 0.1, 0.175 and 0.5 fall between the probabilities 0.5, 0.3, 0.15, 0.05.
    assert torch.isfinite(mask_min_p(LOGITS, min_p)).nonzero().flatten().tolist() == kept


def test_probs_renormalise_what_the_cuts_keep() -> None:
    probs = next_token_probs(LOGITS, settings(top_k=2))
    assert probs.tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0], abs=1e-6)
    assert probs[2:].tolist() == [0.0, 0.0]  # exactly zero: never drawn


def test_temperature_sharpens_or_flattens() -> None:
    logits = torch.tensor([1.0, 0.0])
    sharp = next_token_probs(logits, settings(temperature=0.5))
    assert sharp.tolist() == pytest.approx([1 / (1 + math.exp(-2)), 1 / (1 + math.exp(2))], abs=1e-6)
    flat = next_token_probs(logits, settings(temperature=2.0))
    assert flat.tolist() == pytest.approx([1 / (1 + math.exp(-0.5)), 1 / (1 + math.exp(0.5))], abs=1e-6)


def test_temperature_applies_before_top_p() -> None:
    # At temperature 0.5 the top token holds 0.5² / (0.25 + 0.09 + 0.0225 + 0.0025) ≈ 0.685 of
    # the mass, so top_p 0.6 keeps it alone; at temperature 1 it needs the second token too.
    assert (next_token_probs(LOGITS, settings(top_p=0.6, temperature=0.5)) > 0).tolist() == [
        True,
        False,
        False,
        False,
    ]
    assert (next_token_probs(LOGITS, settings(top_p=0.6)) > 0).tolist() == [True, True, False, False]


@pytest.mark.parametrize(
    "changes",
    [
        {"temperature": 0.7, "top_k": 50},
        {"temperature": 1.3, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
        {"temperature": 1.0, "min_p": 0.1},
    ],
)
def test_probs_match_transformers_warpers(changes: dict[str, float]) -> None:
    logits = torch.randn(2, 1000, generator=torch.Generator().manual_seed(0)) * 3
    chosen = settings(**changes)
    warpers = LogitsProcessorList([TemperatureLogitsWarper(chosen.temperature)])
    if chosen.top_k:
        warpers.append(TopKLogitsWarper(chosen.top_k))
    if chosen.top_p < 1:
        warpers.append(TopPLogitsWarper(chosen.top_p))
    if chosen.min_p:
        warpers.append(MinPLogitsWarper(chosen.min_p))
    expected = warpers(torch.zeros(2, 1, dtype=torch.long), logits.clone()).softmax(dim=-1)
    assert torch.allclose(next_token_probs(logits, chosen), expected, atol=1e-6)


def test_repetition_penalty_matches_transformers() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    previous = torch.tensor([[3, 7, 7, 20, 49]])
    expected = RepetitionPenaltyLogitsProcessor(1.3)(previous, logits.clone())
    assert torch.equal(apply_repetition_penalty(logits, previous, 1.3), expected)


def test_the_decoder_penalty_over_held_tokens_matches_the_reference() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    token_ids = torch.tensor([3, 7, 7, 20, 49, 11])
    held = torch.tensor([True, True, False, True, True, False])  # 7 is held once; 11 is not held
    expected = apply_repetition_penalty(logits, torch.tensor([3, 7, 20, 49]), 1.3)
    assert torch.equal(penalize_held(logits, token_ids, held, 1.3), expected)


def test_greedy_is_argmax_after_the_repetition_penalty() -> None:
    sampler = Sampler(seed=0)
    greedy = settings(temperature=0.0)
    logits = torch.tensor([3.0, 2.0, -1.0])
    assert next_token(sampler, logits, greedy) == 0
    assert next_token(sampler, logits, greedy, previous_ids=torch.tensor([0])) == 0  # penalty 1 by default
    penalised = GenerationSettings(temperature=0.0, repetition_penalty=2.0)
    assert next_token(sampler, logits, penalised, previous_ids=torch.tensor([0])) == 1  # 3 / 2 < 2
    assert sampler.random_state() is None  # greedy draws no random number


def counts_of(reply_ids: list[int], vocab: int) -> torch.Tensor:
    """How often each token was drawn [vocab], as the decoder counts a reply's tokens."""
    return torch.bincount(torch.tensor(reply_ids, dtype=torch.long), minlength=vocab).float()


@pytest.mark.parametrize(
    ("frequency", "presence", "expected"),
    [
        # counts 0, 1, 3, 0, 2: logit - (count * frequency + (count > 0) * presence)
        (0.5, 1.25, [2.0, -1.0 - 0.5 - 1.25, 0.5 - 1.5 - 1.25, 3.0, 0.25 - 1.0 - 1.25]),
        (-0.5, -0.25, [2.0, -1.0 + 0.5 + 0.25, 0.5 + 1.5 + 0.25, 3.0, 0.25 + 1.0 + 0.25]),
        (0.0, 2.0, [2.0, -3.0, -1.5, 3.0, -1.75]),  # presence alone: once, however often
        (2.0, 0.0, [2.0, -3.0, -5.5, 3.0, -3.75]),  # frequency alone: once per draw
    ],
)
def test_frequency_and_presence_penalties_subtract_exactly_openais_formula(frequency, presence, expected) -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.25])
    counts = torch.tensor([0.0, 1.0, 3.0, 0.0, 2.0])
    assert penalize_counts(logits, counts, frequency, presence).tolist() == expected
    reply_ids = [2, 1, 4, 2, 4, 2]  # the same counts, token by token
    assert apply_openai_penalties(logits, reply_ids, frequency, presence).tolist() == expected
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.25]  # the input is left alone


def test_the_decoder_penalties_over_counts_match_the_reference_token_by_token() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3
    reply_ids = [3, 7, 7, 20, 49, 7, 3]
    expected = apply_openai_penalties(logits, reply_ids, 0.7, -0.3)
    assert torch.allclose(penalize_counts(logits, counts_of(reply_ids, 50), 0.7, -0.3), expected, rtol=0, atol=1e-5)
    assert torch.equal(penalize_counts(logits, counts_of([], 50), 0.7, -0.3), logits)  # nothing drawn yet


def test_the_penalties_change_the_distribution_as_openai_defines_it() -> None:
    # Token 0 drawn twice and token 1 once: their probabilities shrink by exp(-2f - p) and exp(-f - p).
    frequency, presence = 0.5, 0.25
    penalized = penalize_counts(LOGITS, counts_of([0, 1, 0], 4), frequency, presence)
    weights = torch.tensor(PROBS, dtype=torch.float64) * torch.tensor([math.exp(-1.25), math.exp(-0.75), 1.0, 1.0])
    expected = (weights / weights.sum()).tolist()
    assert next_token_probs(penalized, settings()).tolist() == pytest.approx(expected, abs=1e-6)
    assert next_token_probs(penalized, settings(temperature=0.5)).tolist() == pytest.approx(
        (weights**2 / (weights**2).sum()).tolist(), abs=1e-6
    )  # the temperature scales the penalized logits


@pytest.mark.parametrize(
    "changes",
    [{"top_k": 50}, {"top_k": 2000}, {"top_p": 0.9}, {"min_p": 0.05}, {"temperature": 0.8, "top_k": 20, "top_p": 0.8}],
)
def test_a_draw_after_the_penalties_is_the_reference_token_of_the_penalized_logits(changes) -> None:
    chosen = settings(**changes, frequency_penalty=0.8, presence_penalty=0.6)
    tokens, uniforms = make_draw(chosen, Sampler(seed=3)), Sampler(seed=3)
    scales = torch.tensor([3.0, 0.2] * 4)[:, None]
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(5)) * scales
    reply_ids: list[int] = []
    for row in logits:
        penalized = penalize_counts(row, counts_of(reply_ids, 1000), chosen.frequency_penalty, chosen.presence_penalty)
        reference = apply_openai_penalties(row, reply_ids, chosen.frequency_penalty, chosen.presence_penalty)
        token = tokens.next_token(penalized)
        assert token == reference_token(reference, chosen, uniforms.uniform(row.device))
        reply_ids.append(token)


def test_greedy_is_argmax_after_the_presence_and_frequency_penalties() -> None:
    logits = torch.tensor([3.0, 2.0, -1.0])
    greedy = make_draw(settings(temperature=0.0), Sampler(seed=0))
    assert greedy.next_token(penalize_counts(logits, counts_of([0], 3), 0.0, 0.9)) == 0  # 2.1 > 2
    assert greedy.next_token(penalize_counts(logits, counts_of([0], 3), 0.0, 1.1)) == 1  # 1.9 < 2
    assert greedy.next_token(penalize_counts(logits, counts_of([0, 0], 3), 0.75, 0.0)) == 1  # 3 - 1.5 < 2
    assert greedy.next_token(penalize_counts(logits, counts_of([0, 1], 3), 0.0, -2.0)) == 0  # both raised by 2


def test_top_k_two_never_draws_the_third_token() -> None:
    tokens = make_draw(settings(top_k=2), Sampler(seed=0))
    draws = {tokens.next_token(LOGITS) for _ in range(300)}
    assert draws == {0, 1}


def test_min_p_never_draws_masked_tokens() -> None:
    tokens = make_draw(settings(min_p=0.35), Sampler(seed=0))
    draws = {tokens.next_token(LOGITS) for _ in range(300)}
    assert draws == {0, 1}


def reference_token(logits: torch.Tensor, chosen: GenerationSettings, uniform: torch.Tensor) -> int:
    """The reference's token at `uniform`: of the tokens ranked by logit, the first whose cumulative mass passes it."""
    order = logits.argsort(descending=True, stable=True)
    cumulative = next_token_probs(logits, chosen)[order].cumsum(dim=-1)
    index = torch.searchsorted(cumulative, uniform * cumulative[-1:], right=True).clamp(max=logits.shape[-1] - 1)
    return int(order[index])


@pytest.mark.parametrize(
    "changes",
    [
        {"top_k": 50},
        {"top_k": 2000},  # more than the vocabulary: no shortlist at all
        {"top_p": 0.9},
        {"top_p": 0.999},
        {"min_p": 0.1},
        {"min_p": 0.001},
        {"temperature": 0.8, "top_k": 20, "top_p": 0.8, "min_p": 0.05},
    ],
)
def test_a_draw_settled_or_redrawn_is_the_reference_token_at_its_number(changes: dict[str, float]) -> None:
    chosen = settings(**changes)
    tokens, uniforms = make_draw(chosen, Sampler(seed=9)), Sampler(seed=9)
    # Sharp rows a shortlist decides, and flat ones it cannot under top-p and min-p.
    scales = torch.tensor([3.0, 0.2] * 4)[:, None]
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(2)) * scales
    for row in logits:
        assert tokens.next_token(row) == reference_token(row, chosen, uniforms.uniform(row.device))


def test_a_shortlist_that_cannot_decide_is_redrawn_at_the_same_number() -> None:
    flat = torch.linspace(0.0, -1.0, 1000)  # top-p 0.9 keeps far more tokens than the shortlist holds
    chosen = settings(top_p=0.9)
    tokens = make_draw(chosen, Sampler(seed=4))
    drawn = tokens(flat)
    assert drawn.settled.tolist() == [False]
    settled = tokens.settle(flat, drawn, (int(drawn.token), False))
    assert settled.redrawn
    assert settled.token == int(settled.on_device) == reference_token(flat, chosen, drawn.uniform)
    assert settled.token >= SHORTLIST  # beyond what the shortlist held: only the redraw could reach it


def test_a_shortlist_that_decides_stands() -> None:
    chosen = settings(top_k=2)
    tokens = make_draw(chosen, Sampler(seed=4))
    drawn = tokens(LOGITS)
    assert drawn.settled.tolist() == [True]
    settled = tokens.settle(LOGITS, drawn, (int(drawn.token), True))
    assert not settled.redrawn
    assert settled.on_device is drawn.token


def draw(sampler: Sampler, count: int = 32, vocab: int = 1000) -> list[int]:
    flat = torch.zeros(vocab)
    tokens = make_draw(settings(), sampler)
    return [tokens.next_token(flat) for _ in range(count)]


def test_same_seed_draws_the_same_tokens() -> None:
    assert draw(Sampler(seed=1234)) == draw(Sampler(seed=1234))


def test_different_seeds_draw_different_tokens() -> None:
    assert draw(Sampler(seed=1)) != draw(Sampler(seed=2))


def test_a_sampler_without_seed_picks_one_that_replays() -> None:
    first = Sampler()
    assert 0 <= first.seed <= MAX_SEED
    assert Sampler().seed != first.seed  # a fresh one each time (fails with odds 2**-64)
    assert draw(Sampler(first.seed)) == draw(first)


def test_sampling_ignores_torch_global_seed() -> None:
    torch.manual_seed(0)
    before = draw(Sampler(seed=5))
    torch.manual_seed(1)
    assert draw(Sampler(seed=5)) == before


def test_half_precision_logits_are_sampled_in_float32() -> None:
    probs = next_token_probs(LOGITS.to(torch.bfloat16), settings(top_k=2))
    assert probs.dtype == torch.float32
    assert make_draw(settings(top_k=2), Sampler(seed=0)).next_token(LOGITS.to(torch.bfloat16)) in (0, 1)
