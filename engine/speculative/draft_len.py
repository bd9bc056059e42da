"""How many tokens to draft per verify step: MoESD's expected-expert count and speedup model.

Contract: pure functions of measured numbers, no model and no clock.

- `unique_experts(E, K, t)`: N(t) = E·(1 - ((E - K)/E)^t), the expected number of distinct
  experts t tokens route to in one layer, each picking K of E uniformly (MoESD).
- `expected_accept_len(α, γ)`: mean tokens emitted per verify step, bonus included, when each
  draft token is accepted with probability α independently: (1 - α^(γ+1)) / (1 - α).
- `alpha_from_acceptance(ρ, γ)`: that per-token α from a measured ratio ρ = accepted / drafted
  at draft length γ. They differ: the draft stops being judged at its first rejection, so
  ρ = α·(1 - α^γ) / ((1 - α)·γ) is below α for every γ > 1.
- `best_draft_len`: the γ that maximises expected tokens per unit time,
  E[len](γ) / (γ·draft_token_ms + verify_ms(γ + 1)); ties go to the shorter draft.
- `verify_cost_model`: verify_ms(n) for an offloaded MoE, from measured per-layer numbers.
- `DraftLengthController`: estimates α online from verify outcomes and re-chooses γ.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass


def unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by `tokens` tokens routed top-`top_k` of `num_experts`."""
    if num_experts < 1 or not 0 <= top_k <= num_experts or tokens < 0:
        raise ValueError(
            f"need num_experts >= 1, 0 <= top_k <= num_experts, tokens >= 0; "
            f"got num_experts={num_experts}, top_k={top_k}, tokens={tokens}"
        )
    miss_one = (num_experts - top_k) / num_experts  # P(one token does not pick a given expert)
    return num_experts * (1.0 - miss_one**tokens)


def expected_accept_len(alpha: float, draft_len: int) -> float:
    """Mean tokens emitted per verify step (bonus included) for per-token acceptance `alpha`."""
    _check_alpha(alpha)
    if draft_len < 0:
        raise ValueError(f"draft_len must be >= 0, got {draft_len}")
    if alpha == 1.0:
        return float(draft_len + 1)
    return (1.0 - alpha ** (draft_len + 1)) / (1.0 - alpha)


def alpha_from_acceptance(rate: float, draft_len: float) -> float:
    """The per-token α whose expected accepted/drafted ratio at draft length γ is `rate`.

    Solves ρ = α·(1 − α^γ) / ((1 − α)·γ) by bisection (the right side rises from 0 at α = 0
    to 1 at α = 1); γ may be a mean over verify steps, so it need not be whole.
    """
    _check_alpha(rate)
    if draft_len < 1:
        raise ValueError(f"draft_len must be >= 1, got {draft_len}")
    if rate in (0.0, 1.0):
        return rate

    def ratio(alpha: float) -> float:
        return alpha * (1.0 - alpha**draft_len) / ((1.0 - alpha) * draft_len)

    low, high = 0.0, 1.0
    for _ in range(60):  # 2^-60: far below any measured rate's noise
        mid = (low + high) / 2
        low, high = (mid, high) if ratio(mid) < rate else (low, mid)
    return (low + high) / 2


def best_draft_len(
    alpha: float,
    draft_token_ms: float,
    verify_ms: Callable[[int], float],
    max_len: int,
    min_len: int = 1,
) -> int:
    """The draft length in [min_len, max_len] with the most expected tokens per millisecond.

    `draft_token_ms` is the cost of drafting one token; `verify_ms(n)` the cost of one target
    forward over n tokens (γ drafted + the last accepted one). Ties go to the shorter draft,
    which wastes less work when α turns out lower than estimated.
    """
    _check_alpha(alpha)
    if not 0 <= min_len <= max_len:
        raise ValueError(f"need 0 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if not draft_token_ms >= 0:
        raise ValueError(f"draft_token_ms must be >= 0, got {draft_token_ms}")
    best_len, best_rate = min_len, -1.0
    for draft_len in range(min_len, max_len + 1):
        step_ms = draft_len * draft_token_ms + verify_ms(draft_len + 1)
        if not step_ms > 0:
            raise ValueError(
                f"a draft+verify step must take positive time, got {step_ms} ms for γ={draft_len}"
            )
        rate = expected_accept_len(alpha, draft_len) / step_ms
        if rate > best_rate:
            best_len, best_rate = draft_len, rate
    return best_len


@dataclass(frozen=True)
class VerifyCostModel:
    """verify_ms(n) = moe_layers · (layer_ms(n) + misses(n) · load_ms) for an offloaded MoE.

    misses(n) = unique_experts(num_experts, top_k, n) · (1 - cached_fraction): the distinct
    experts n tokens need in a layer, of which `cached_fraction` are expected resident (the
    measured verify-phase hit rate, or prefetch recall). `layer_ms(n)` is the measured compute
    of one layer over n tokens (attention, router, shared and routed experts' math); a float
    means it does not depend on n, as in the memory-bound regime MoESD describes. Copies are
    taken as not overlapping compute, an upper bound when prefetch hides some of them.
    """

    moe_layers: int
    num_experts: int
    top_k: int
    layer_ms: float | Callable[[int], float]
    load_ms: float
    cached_fraction: float

    def __post_init__(self) -> None:
        if self.moe_layers < 1:
            raise ValueError(f"moe_layers must be >= 1, got {self.moe_layers}")
        unique_experts(self.num_experts, self.top_k, 0)  # validates the routing shape
        if not self.load_ms >= 0:
            raise ValueError(f"load_ms must be >= 0, got {self.load_ms}")
        if not 0.0 <= self.cached_fraction <= 1.0:
            raise ValueError(f"cached_fraction must be in [0, 1], got {self.cached_fraction}")

    def misses(self, tokens: int) -> float:
        """Expected experts to copy per layer for a verify over `tokens` tokens."""
        return unique_experts(self.num_experts, self.top_k, tokens) * (1.0 - self.cached_fraction)

    def __call__(self, tokens: int) -> float:
        compute_ms = self.layer_ms(tokens) if callable(self.layer_ms) else self.layer_ms
        return self.moe_layers * (compute_ms + self.misses(tokens) * self.load_ms)


def verify_cost_model(
    *,
    moe_layers: int,
    num_experts: int,
    top_k: int,
    layer_ms: float | Callable[[int], float],
    load_ms: float,
    cached_fraction: float,
) -> VerifyCostModel:
    """verify_ms(n) for `best_draft_len`, from measured per-layer numbers (see `VerifyCostModel`)."""
    return VerifyCostModel(moe_layers, num_experts, top_k, layer_ms, load_ms, cached_fraction)


class DraftLengthController:
    """Chooses the draft length from the acceptance rate seen so far.

    α is estimated as accepted / (accepted + rejections) over the draft positions actually
    judged: a chain stops at its first rejection, so the positions after it say nothing about
    α (counting them as failures would bias α low). The counts decay by `decay` per update,
    so the estimate follows a conversation whose predictability changes (about 1 / (1 - decay)
    verify steps of memory), and start from a Beta prior worth `prior_weight` positions at
    `prior_alpha`.

    With a cost model (`draft_token_ms` and `verify_ms`) `draft_len` is `best_draft_len` of
    the current α. Without one it assumes a verify costs the same for any n and a draft token
    `draft_cost_ratio` of a verify. With `adapt=False` it always answers `initial_len`, while
    still tracking α for the metrics.
    """

    def __init__(
        self,
        initial_len: int = 4,
        *,
        min_len: int = 1,
        max_len: int = 8,
        adapt: bool = True,
        prior_alpha: float = 0.7,
        prior_weight: float = 4.0,
        decay: float = 0.98,
        draft_token_ms: float | None = None,
        verify_ms: Callable[[int], float] | None = None,
        draft_cost_ratio: float = 0.1,
    ) -> None:
        if not 1 <= min_len <= initial_len <= max_len:
            raise ValueError(
                f"need 1 <= min_len <= initial_len <= max_len, "
                f"got min_len={min_len}, initial_len={initial_len}, max_len={max_len}"
            )
        _check_alpha(prior_alpha)
        if not prior_weight > 0 or not 0 < decay <= 1 or not draft_cost_ratio > 0:
            raise ValueError("need prior_weight > 0, 0 < decay <= 1 and draft_cost_ratio > 0")
        if (draft_token_ms is None) != (verify_ms is None):
            raise ValueError("give both draft_token_ms and verify_ms, or neither")
        self.initial_len, self.min_len, self.max_len, self.adapt = initial_len, min_len, max_len, adapt
        self.decay = decay
        self._prior = (prior_alpha * prior_weight, (1.0 - prior_alpha) * prior_weight)
        if draft_token_ms is None or verify_ms is None:
            self._draft_token_ms, self._verify_ms = draft_cost_ratio, _flat_verify_ms
        else:
            self._draft_token_ms, self._verify_ms = draft_token_ms, verify_ms
        self.reset()

    def reset(self) -> None:
        """Forget every outcome seen (a new conversation); α returns to the prior."""
        self._accepted = 0.0  # decayed count of accepted positions
        self._rejected = 0.0  # decayed count of rejected positions

    def update(self, accepted: int, drafted: int, stopped_early: bool = False) -> None:
        """Record one verify step: `accepted` of `drafted` draft tokens were kept.

        `stopped_early`: the chain was cut before all drafted positions were judged for a reason
        other than a rejection (a stop token or the token limit inside the accepted prefix, a
        cancellation); then no position was rejected. Otherwise `accepted < drafted` means
        position `accepted` was rejected.
        """
        if not 0 <= accepted <= drafted:
            raise ValueError(f"need 0 <= accepted <= drafted, got accepted={accepted}, drafted={drafted}")
        rejected = 1 if accepted < drafted and not stopped_early else 0
        self._accepted = self.decay * self._accepted + accepted
        self._rejected = self.decay * self._rejected + rejected

    @property
    def alpha(self) -> float:
        """Current estimate of the per-token acceptance probability (posterior mean)."""
        kept, lost = self._prior[0] + self._accepted, self._prior[1] + self._rejected
        return kept / (kept + lost)

    @property
    def draft_len(self) -> int:
        """How many tokens to draft next."""
        if not self.adapt:
            return self.initial_len
        return best_draft_len(self.alpha, self._draft_token_ms, self._verify_ms, self.max_len, self.min_len)


def _flat_verify_ms(tokens: int) -> float:
    return 1.0


def _check_alpha(alpha: float) -> None:
    if not (math.isfinite(alpha) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
