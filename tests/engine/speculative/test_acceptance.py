"""Acceptance of drafted chains: greedy cases by hand, rejection sampling checked statistically.

The statistical tests are seeded, so they are deterministic; the chi-squared threshold (p-value
1e-3) is far from the values the seeded runs give, and the adaptive-mode test shows the same
check rejects a biased sampler with a p-value below 1e-9.
"""

from collections import Counter

import pytest
import torch

from engine.speculative.acceptance import Verdict, adaptive_accept, greedy_accept, rejection_accept

VOCAB = 5
TRIALS = 20_000
P_VALUE_FLOOR = 1e-3


def _chi_squared_p_value(observed: list[float], expected: list[float], dof: int) -> float:
    """Upper tail of the chi-squared distribution at Pearson's statistic."""
    for count in expected:
        assert count >= 5, "too few expected counts for the chi-squared approximation"
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True))
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(statistic / 2.0)))


def _distributions(seed: int, *shape: int) -> torch.Tensor:
    """Random distributions over VOCAB tokens, no probability tiny: [*shape, VOCAB]."""
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(*shape, VOCAB, generator=generator), dim=-1)


# -- Verdict --------------------------------------------------------------------------------


def test_verdict_emits_accepted_plus_one_tokens() -> None:
    verdict = Verdict(2, (7, 8, 9))
    assert verdict.next_token == 9
    with pytest.raises(ValueError, match="accepted \\+ 1"):
        Verdict(2, (7, 8))


# -- greedy ---------------------------------------------------------------------------------


def _one_hot_rows(ids: list[int], vocab: int = 6) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), vocab).float()  # [len(ids), V]


def test_greedy_all_accepted_then_bonus() -> None:
    verdict = greedy_accept([3, 1, 4], _one_hot_rows([3, 1, 4, 5]))
    assert verdict == Verdict(3, (3, 1, 4, 5))


def test_greedy_stops_at_first_mismatch_with_the_targets_token() -> None:
    verdict = greedy_accept([3, 1, 4], _one_hot_rows([3, 2, 4, 5]))
    assert verdict == Verdict(1, (3, 2))


def test_greedy_first_token_wrong_emits_correction_only() -> None:
    assert greedy_accept([0, 1], _one_hot_rows([2, 1, 1])) == Verdict(0, (2,))


def test_greedy_ties_go_to_the_first_maximal_index() -> None:
    logits = torch.tensor([[0.0, 2.0, 0.0, 2.0], [1.0, 1.0, 1.0, 1.0]])  # [2, V]
    assert greedy_accept([3], logits) == Verdict(0, (1,))  # argmax of row 0 is 1, not 3
    assert greedy_accept([1], logits) == Verdict(1, (1, 0))


def test_greedy_empty_draft_emits_the_targets_token() -> None:
    assert greedy_accept([], _one_hot_rows([4])) == Verdict(0, (4,))


def test_greedy_checks_the_number_of_rows() -> None:
    with pytest.raises(ValueError, match="target_logits must have shape \\[3, V\\]"):
        greedy_accept([1, 2], _one_hot_rows([1, 2]))


# -- rejection sampling: exact cases ---------------------------------------------------------


def test_target_as_its_own_draft_accepts_every_token() -> None:
    generator = torch.Generator().manual_seed(1)
    probs = _distributions(2, 4)  # [γ+1, V]
    for _ in range(200):
        draft = [int(torch.multinomial(row, 1, generator=generator)) for row in probs[:3]]
        verdict = rejection_accept(draft, probs[:3], probs, generator)
        assert verdict.accepted == 3
        assert verdict.tokens[:3] == tuple(draft)


def test_token_the_draft_gave_no_probability_is_kept_when_the_target_allows_it() -> None:
    draft_probs = torch.tensor([[0.5, 0.5, 0.0]])
    target_probs = torch.tensor([[0.2, 0.2, 0.6], [0.0, 0.0, 1.0]])
    verdict = rejection_accept([2], draft_probs, target_probs, torch.Generator().manual_seed(0))
    assert verdict == Verdict(1, (2, 2))


def test_empty_residual_falls_back_to_the_target() -> None:
    # p == q, and the drafted token has p = q = 0: rejected, and max(0, p - q) has no mass.
    probs = torch.tensor([[0.5, 0.5, 0.0]])
    target_probs = torch.cat([probs, probs])  # [2, V]
    generator = torch.Generator().manual_seed(0)
    corrections = {rejection_accept([2], probs, target_probs, generator).tokens for _ in range(50)}
    assert corrections == {(0,), (1,)}


def test_rejection_checks_shapes() -> None:
    probs = _distributions(0, 3)
    with pytest.raises(ValueError, match="draft_probs must have shape \\[2, V\\]"):
        rejection_accept([1, 2], probs, probs)
    with pytest.raises(ValueError, match="draft tokens must be in \\[0, 5\\)"):
        rejection_accept([1, 9], probs[:2], probs)
    with pytest.raises(ValueError, match="vocabularies differ"):
        rejection_accept([1], probs[:1, :4], probs[:2])


# -- rejection sampling: the emitted stream is distributed as the target --------------------


class TwoStepChain:
    """Context-dependent draft (q) and target (p) distributions for a two-token chain."""

    def __init__(self) -> None:
        self.q0, self.q1 = _distributions(10), _distributions(11, VOCAB)  # [V], [V, V]
        self.p0, self.p1 = _distributions(20), _distributions(21, VOCAB)  # [V], [V, V]
        self.p2 = _distributions(22, VOCAB, VOCAB)  # [V, V, V]: the bonus after (a, b)

    def first_two_tokens(self, trials: int, seed: int) -> list[tuple[int, int]]:
        """The first two tokens of the output stream, for `trials` independent runs."""
        draft_gen = torch.Generator().manual_seed(seed)
        accept_gen = torch.Generator().manual_seed(seed + 1)
        x0 = torch.multinomial(self.q0, trials, replacement=True, generator=draft_gen)  # [N]
        x1 = torch.multinomial(self.q1[x0], 1, generator=draft_gen)[:, 0]  # [N]
        pairs = []
        for a, b in zip(x0.tolist(), x1.tolist(), strict=True):
            draft_probs = torch.stack([self.q0, self.q1[a]])  # [2, V]
            target_probs = torch.stack([self.p0, self.p1[a], self.p2[a, b]])  # [3, V]
            tokens = rejection_accept([a, b], draft_probs, target_probs, accept_gen).tokens
            if len(tokens) == 1:  # rejected at once: the next round drafts after tokens[0]
                tokens += self._next_round(tokens[0], draft_gen, accept_gen)
            pairs.append((tokens[0], tokens[1]))
        return pairs

    def _next_round(
        self, first: int, draft_gen: torch.Generator, accept_gen: torch.Generator
    ) -> tuple[int, ...]:
        drafted = int(torch.multinomial(self.q1[first], 1, generator=draft_gen))
        target_probs = torch.stack([self.p1[first], self.p2[first, drafted]])  # [2, V]
        return rejection_accept([drafted], self.q1[first][None], target_probs, accept_gen).tokens[:1]


@pytest.fixture(scope="module")
def chain() -> TwoStepChain:
    return TwoStepChain()


@pytest.fixture(scope="module")
def stream(chain: TwoStepChain) -> list[tuple[int, int]]:
    return chain.first_two_tokens(TRIALS, seed=1234)


def test_chain_rejects_often_enough_to_exercise_the_correction(chain: TwoStepChain) -> None:
    # Total variation distance of the first position: the rejection probability there.
    assert 0.2 < float((chain.p0 - chain.q0).abs().sum()) / 2 < 0.8


def test_first_token_is_distributed_as_the_target(chain: TwoStepChain, stream) -> None:
    counts = Counter(first for first, _ in stream)
    observed = [counts[token] for token in range(VOCAB)]
    expected = (chain.p0 * TRIALS).tolist()
    assert _chi_squared_p_value(observed, expected, dof=VOCAB - 1) > P_VALUE_FLOOR


def test_second_token_given_the_first_is_distributed_as_the_target(chain: TwoStepChain, stream) -> None:
    firsts = Counter(first for first, _ in stream)
    pairs = Counter(stream)
    observed, expected = [], []
    for a in range(VOCAB):
        for b in range(VOCAB):
            observed.append(pairs[(a, b)])
            expected.append(firsts[a] * float(chain.p1[a, b]))
    p_value = _chi_squared_p_value(observed, expected, dof=VOCAB * (VOCAB - 1))
    assert p_value > P_VALUE_FLOOR


# -- adaptive acceptance is biased, as its label says ---------------------------------------


def _first_tokens(accept, draft_probs: torch.Tensor, target_probs: torch.Tensor, trials: int) -> list[int]:
    generator = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(draft_probs[0], trials, replacement=True, generator=generator).tolist()
    return [accept([x], draft_probs, target_probs, generator).tokens[0] for x in drafts]


def test_adaptive_acceptance_is_not_lossless() -> None:
    # A confident draft token the target finds a little less likely is always kept:
    # P(first = 0) = q(0) + (1 - q(0)) * p(0) = 0.9, where the target says 0.5.
    draft_probs = torch.tensor([[0.8, 0.1, 0.1]])
    target_probs = torch.tensor([[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]])
    trials = 4_000
    expected = (target_probs[0] * trials).tolist()

    def adaptive(draft, q, p, generator):
        return adaptive_accept(draft, q, p, tau=0.5, tolerance=0.5, generator=generator)

    biased = Counter(_first_tokens(adaptive, draft_probs, target_probs, trials))
    assert abs(biased[0] / trials - 0.9) < 0.02
    assert _chi_squared_p_value([biased[t] for t in range(3)], expected, dof=2) < 1e-9

    exact = Counter(_first_tokens(rejection_accept, draft_probs, target_probs, trials))
    assert _chi_squared_p_value([exact[t] for t in range(3)], expected, dof=2) > P_VALUE_FLOOR


def test_adaptive_keeps_confident_agreeing_tokens_and_stops_at_the_first_other() -> None:
    draft_probs = torch.tensor([[0.9, 0.1, 0.0], [0.2, 0.8, 0.0], [0.0, 0.3, 0.7]])
    target_probs = torch.tensor([[0.6, 0.4, 0.0], [0.2, 0.1, 0.7], [0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    generator = torch.Generator().manual_seed(0)
    # token 0: q 0.9 > tau, p/q 0.67 > 0.5 kept; token 1: p/q 0.125 fails, sampled from p
    verdict = adaptive_accept([0, 1, 2], draft_probs, target_probs, 0.5, 0.5, generator)
    assert verdict.accepted == 1
    assert verdict.tokens[0] == 0
    assert verdict.tokens[1] in {0, 1, 2}
    all_kept = adaptive_accept([0], draft_probs[:1], target_probs[[0, 3]], 0.5, 0.5, generator)
    assert all_kept == Verdict(1, (0, 0))  # bonus from the last row, one-hot on 0


def test_adaptive_validates_its_thresholds() -> None:
    probs = _distributions(0, 2)
    with pytest.raises(ValueError, match="tau"):
        adaptive_accept([1], probs[:1], probs, tau=1.5, tolerance=0.1)
    with pytest.raises(ValueError, match="tolerance"):
        adaptive_accept([1], probs[:1], probs, tau=0.5, tolerance=-0.1)
