"""Draft length: MoESD's formulas, the speedup-model argmax and the online controller."""

import math
import random

import pytest

from engine.speculative.draft_len import (
    DraftLengthController,
    alpha_from_acceptance,
    best_draft_len,
    expected_accept_len,
    unique_experts,
    verify_cost_model,
)


def test_unique_experts_matches_the_formula_and_its_limits() -> None:
    assert unique_experts(8, 2, 0) == 0.0
    assert unique_experts(8, 2, 1) == pytest.approx(2.0)
    assert unique_experts(8, 2, 2) == pytest.approx(8 * (1 - 0.75**2))  # 3.5
    assert unique_experts(128, 8, 1000) == pytest.approx(128.0)
    assert unique_experts(8, 8, 1) == 8.0
    with pytest.raises(ValueError, match="top_k <= num_experts"):
        unique_experts(8, 9, 1)


def test_expected_accept_len() -> None:
    assert expected_accept_len(0.0, 5) == 1.0  # the correction token only
    assert expected_accept_len(1.0, 5) == 6.0  # all drafted + bonus
    assert expected_accept_len(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert expected_accept_len(0.8, 0) == 1.0
    with pytest.raises(ValueError, match="alpha"):
        expected_accept_len(1.2, 3)


def test_alpha_from_acceptance_inverts_the_accepted_over_drafted_ratio() -> None:
    # by hand: α = 0.5, γ = 2 accepts 0.5 + 0.25 = 0.75 of 2 drafted tokens per step, ρ = 0.375
    assert alpha_from_acceptance(0.375, 2) == pytest.approx(0.5)
    assert alpha_from_acceptance(0.6, 1) == pytest.approx(0.6)  # one draft token: ρ is α
    assert alpha_from_acceptance(0.0, 4) == 0.0 and alpha_from_acceptance(1.0, 4) == 1.0
    for rate in (0.1, 0.45, 0.71, 0.93):
        for draft_len in (2, 4, 5.5, 12):
            alpha = alpha_from_acceptance(rate, draft_len)
            assert alpha > rate  # a rejection also fails the positions after it
            # the fitted α gives back the measured accepted tokens per step, γ·ρ
            assert alpha * (1 - alpha**draft_len) / (1 - alpha) == pytest.approx(rate * draft_len)
    with pytest.raises(ValueError, match="alpha"):
        alpha_from_acceptance(1.5, 4)
    with pytest.raises(ValueError, match="draft_len"):
        alpha_from_acceptance(0.5, 0)


def simulated_accepted(alpha: float, draft_len: int, steps: int, seed: int) -> list[int]:
    """Accepted draft tokens per verify step: each accepted with probability α, up to the first rejection."""
    rng = random.Random(seed)
    counts = []
    for _ in range(steps):
        accepted = 0
        while accepted < draft_len and rng.random() < alpha:
            accepted += 1
        counts.append(accepted)
    return counts


def test_alpha_from_acceptance_recovers_alpha_from_simulated_chains() -> None:
    accepted = simulated_accepted(alpha=0.8, draft_len=4, steps=20_000, seed=1)
    assert alpha_from_acceptance(sum(accepted) / (len(accepted) * 4), 4) == pytest.approx(0.8, abs=0.01)


def test_expected_accept_len_is_the_mean_of_simulated_chains() -> None:
    accepted = simulated_accepted(alpha=0.7, draft_len=4, steps=20_000, seed=0)
    emitted = [n + 1 for n in accepted]  # the bonus (or correction) token
    assert sum(emitted) / len(emitted) == pytest.approx(expected_accept_len(0.7, 4), rel=0.02)


def _flat(tokens: int) -> float:
    return 10.0


def test_best_draft_len_grows_with_alpha() -> None:
    lengths = [best_draft_len(alpha, 1.0, _flat, max_len=16) for alpha in (0.2, 0.5, 0.8, 0.95)]
    assert lengths == sorted(lengths)
    assert lengths[0] < lengths[-1]
    assert best_draft_len(1.0, 1.0, _flat, max_len=16) == 16
    assert best_draft_len(0.0, 1.0, _flat, max_len=16) == 1
    assert best_draft_len(0.0, 1.0, _flat, max_len=16, min_len=0) == 0


def test_best_draft_len_is_the_argmax_of_tokens_per_ms() -> None:
    def rate(draft_len: int) -> float:
        return expected_accept_len(0.75, draft_len) / (draft_len * 2.0 + _flat(draft_len + 1))

    assert best_draft_len(0.75, 2.0, _flat, max_len=12) == max(range(1, 13), key=rate)


def test_costly_verify_of_many_tokens_shortens_drafts() -> None:
    flat = best_draft_len(0.8, 0.5, _flat, max_len=16)
    steep = best_draft_len(0.8, 0.5, lambda n: 10.0 + 4.0 * n, max_len=16)
    assert steep < flat


def test_best_draft_len_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="min_len <= max_len"):
        best_draft_len(0.5, 1.0, _flat, max_len=2, min_len=3)
    with pytest.raises(ValueError, match="positive time"):
        best_draft_len(0.5, 0.0, lambda n: 0.0, max_len=4)


def test_verify_cost_model_counts_compute_and_missing_experts() -> None:
    model = verify_cost_model(
        moe_layers=10,
        num_experts=8,
        top_k=2,
        layer_ms=lambda n: 1.0 + 0.1 * n,
        load_ms=5.0,
        cached_fraction=0.5,
    )
    # one token: 2 experts, half of them resident: 1 copy per layer
    assert model(1) == pytest.approx(10 * (1.1 + 1.0 * 5.0))
    assert model.misses(2) == pytest.approx(3.5 * 0.5)
    all_cached = verify_cost_model(
        moe_layers=10, num_experts=8, top_k=2, layer_ms=2.0, load_ms=5.0, cached_fraction=1.0
    )
    assert all_cached(7) == pytest.approx(20.0)
    with pytest.raises(ValueError, match="cached_fraction"):
        verify_cost_model(
            moe_layers=1, num_experts=8, top_k=2, layer_ms=1.0, load_ms=1.0, cached_fraction=2.0
        )


def test_offloaded_verify_cost_prefers_short_drafts_when_copies_dominate() -> None:
    common = {"moe_layers": 24, "num_experts": 64, "top_k": 8, "layer_ms": 0.5, "load_ms": 2.0}
    copies_hidden = verify_cost_model(**common, cached_fraction=1.0)
    copies_exposed = verify_cost_model(**common, cached_fraction=0.2)
    assert best_draft_len(0.8, 3.0, copies_exposed, 16) < best_draft_len(0.8, 3.0, copies_hidden, 16)


# -- the controller ------------------------------------------------------------------------


def _verify_outcome(rng: random.Random, alpha: float, drafted: int) -> int:
    """Accepted count of one chain whose tokens are each accepted with probability alpha."""
    accepted = 0
    while accepted < drafted and rng.random() < alpha:
        accepted += 1
    return accepted


@pytest.mark.parametrize("true_alpha", [0.3, 0.6, 0.9])
def test_alpha_estimate_converges(true_alpha: float) -> None:
    rng = random.Random(7)
    controller = DraftLengthController(decay=1.0)
    for _ in range(3000):
        drafted = controller.draft_len
        controller.update(_verify_outcome(rng, true_alpha, drafted), drafted)
    assert controller.alpha == pytest.approx(true_alpha, abs=0.02)


def test_naive_accepted_over_drafted_would_be_biased() -> None:
    # The reason for counting judged positions only: at alpha 0.9 with 8 drafted,
    # accepted / drafted averages ~0.71.
    rng = random.Random(3)
    outcomes = [_verify_outcome(rng, 0.9, 8) for _ in range(4000)]
    assert sum(outcomes) / (8 * len(outcomes)) < 0.75
    controller = DraftLengthController(decay=1.0)
    for accepted in outcomes:
        controller.update(accepted, 8)
    assert controller.alpha == pytest.approx(0.9, abs=0.01)


def test_estimate_follows_a_change_in_acceptance() -> None:
    rng = random.Random(11)
    controller = DraftLengthController(decay=0.95)
    for true_alpha in (0.9, 0.25):
        for _ in range(400):
            drafted = controller.draft_len
            controller.update(_verify_outcome(rng, true_alpha, drafted), drafted)
        assert controller.alpha == pytest.approx(true_alpha, abs=0.1)


def test_high_acceptance_drafts_longer_than_low() -> None:
    high, low = DraftLengthController(max_len=12), DraftLengthController(max_len=12)
    for _ in range(100):
        high.update(6, 6)
        low.update(0, 4)
    assert high.draft_len > 4 > low.draft_len


def test_bounds_are_respected() -> None:
    controller = DraftLengthController(initial_len=3, min_len=2, max_len=5)
    for _ in range(200):
        controller.update(5, 5)
    assert controller.draft_len == 5
    for _ in range(400):
        controller.update(0, 5)
    assert controller.draft_len == 2


def test_stopped_early_counts_no_rejection() -> None:
    controller = DraftLengthController(prior_alpha=0.5, prior_weight=2.0, decay=1.0)
    controller.update(2, 5, stopped_early=True)  # a stop token inside the accepted prefix
    assert controller.alpha == pytest.approx(3 / 4)
    controller.update(2, 5)  # position 2 rejected
    assert controller.alpha == pytest.approx(5 / 7)
    controller.update(5, 5)  # all kept: no rejection
    assert controller.alpha == pytest.approx(10 / 12)


def test_fixed_mode_keeps_the_initial_length() -> None:
    controller = DraftLengthController(initial_len=3, adapt=False)
    for _ in range(100):
        controller.update(0, 3)
    assert controller.draft_len == 3
    assert controller.alpha < 0.1  # still tracked for the metrics


def test_cost_model_drives_the_choice() -> None:
    def steep(n: int) -> float:
        return 5.0 + 5.0 * n

    flat = DraftLengthController(max_len=16, draft_token_ms=1.0, verify_ms=_flat)
    costly = DraftLengthController(max_len=16, draft_token_ms=1.0, verify_ms=steep)
    for _ in range(100):
        for controller in (flat, costly):
            controller.update(3, 4)
    assert costly.draft_len == best_draft_len(costly.alpha, 1.0, steep, 16)
    assert costly.draft_len < flat.draft_len


def test_reset_returns_to_the_prior() -> None:
    controller = DraftLengthController(prior_alpha=0.6)
    controller.update(0, 4)
    controller.reset()
    assert math.isclose(controller.alpha, 0.6)


def test_controller_validates_its_settings() -> None:
    with pytest.raises(ValueError, match="min_len <= initial_len <= max_len"):
        DraftLengthController(initial_len=9, max_len=8)
    with pytest.raises(ValueError, match="both"):
        DraftLengthController(draft_token_ms=1.0)
    with pytest.raises(ValueError, match="accepted <= drafted"):
        DraftLengthController().update(3, 2)
