"""Accept or reject a drafted chain of tokens against the target's distributions.

Contract: every function judges one chain `draft` of γ tokens (γ >= 0) drafted after the
same context, with the target's distributions for all γ + 1 positions from one verify
forward (row i is the target's distribution for the token after context + draft[:i]; row γ
gives the bonus token). It returns a `Verdict`: `accepted` draft tokens (0..γ) and `tokens`,
the tokens to emit, which are always `draft[:accepted]` followed by one more token, the
correction (a draft token was rejected) or the bonus (all were accepted). So every verify step
emits `accepted + 1` tokens, the `accept_len` of the metrics.

- `greedy_accept`: lossless for greedy decoding. A draft token is kept while it equals the
  target's argmax; ties resolve as `torch.argmax` does (the first maximal index).
- `rejection_accept`: lossless speculative sampling (Leviathan et al. 2023, Chen et al. 2023):
  the emitted tokens are distributed exactly as if sampled one by one from the target,
  provided every draft token was sampled from its row of `draft_probs`.
- `adaptive_accept`: SS-MoE's adaptive mode (section 3.4, T > 0). NOT lossless: it keeps
  confident draft tokens the target finds nearly as likely, trading exactness for longer
  accepted chains. Opt-in, and must be labelled as approximate wherever it is offered.

Probabilities are the ones `engine.sampling.Sampler.probs` returns (processed, softmaxed);
pass the processed scores (or those one-hot probabilities) to `greedy_accept`. All tensor
work stays on the probabilities' device; a `generator`, when given, must live there too.
Each call reads back to the host once to find the first rejection and once per draw (a
rejection adds one more, to check the residual has mass).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.sampling import argmaxes


@dataclass(frozen=True)
class Verdict:
    """Outcome of verifying one drafted chain."""

    accepted: int  # draft tokens kept, 0..γ
    tokens: tuple[int, ...]  # draft[:accepted] + (correction or bonus token,)

    def __post_init__(self) -> None:
        if self.accepted < 0 or len(self.tokens) != self.accepted + 1:
            raise ValueError(
                f"a verdict emits accepted + 1 tokens; got accepted={self.accepted}, tokens={self.tokens}"
            )

    @property
    def next_token(self) -> int:
        """The token the target chose after the accepted prefix (correction or bonus)."""
        return self.tokens[-1]


def greedy_accept(draft: Sequence[int], target_logits: torch.Tensor) -> Verdict:
    """Keep draft tokens while they equal the target's argmax; then emit the target's argmax.

    `target_logits` [γ+1, V]: processed scores (or probabilities) for each verified position.
    """
    draft_ids = _as_ids(draft)
    _check_rows(target_logits, len(draft_ids) + 1, "target_logits")
    target_ids = argmaxes(target_logits)  # [γ+1], the one host read
    accepted = 0
    while accepted < len(draft_ids) and draft_ids[accepted] == target_ids[accepted]:
        accepted += 1
    return Verdict(accepted, (*draft_ids[:accepted], int(target_ids[accepted])))


def rejection_accept(
    draft: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None = None,
) -> Verdict:
    """Standard speculative sampling: lossless when each draft token was drawn from `draft_probs`.

    Token i (x, drafted with probability q(x), target probability p(x)) is kept with probability
    min(1, p(x) / q(x)); the first rejected position emits a sample of norm(max(0, p - q)); when
    all are kept the bonus is sampled from `target_probs[γ]`.
    `draft_probs` [γ, V], `target_probs` [γ+1, V].

    Robustness: the test is u·q(x) < p(x) with u ~ U[0, 1), so q(x) = 0 (impossible when x was
    sampled from q) keeps x exactly when p(x) > 0; when max(0, p - q) has no mass (only
    possible through rounding, or a draft token with p(x) = q(x) = 0) the correction is
    sampled from p.
    """
    draft_ids = _as_ids(draft)
    gamma = len(draft_ids)
    _check_pair(draft_probs, target_probs, gamma)
    p_drafted, q_drafted = _drafted_probs(draft_ids, draft_probs, target_probs)  # [γ], [γ]
    uniform = torch.rand(gamma, generator=generator, device=target_probs.device)  # [γ]
    kept = (uniform * q_drafted < p_drafted).tolist()
    accepted = _leading_true(kept)
    if accepted == gamma:
        return Verdict(gamma, (*draft_ids, _draw(target_probs[gamma], generator)))
    p_row = target_probs[accepted].float()  # [V]
    residual = (p_row - draft_probs[accepted].float()).clamp_min(0.0)  # [V]
    # One read-back for the fallback decision; a NaN sum also falls back to p.
    weights = residual if bool(residual.sum() > 0) else p_row
    return Verdict(accepted, (*draft_ids[:accepted], _draw(weights, generator)))


def adaptive_accept(
    draft: Sequence[int],
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    tau: float,
    tolerance: float,
    generator: torch.Generator | None = None,
) -> Verdict:
    """SS-MoE adaptive acceptance. NOT lossless: the output distribution differs from the target's.

    Draft token x is kept when the draft was confident, q(x) > `tau`, and the target nearly
    agrees, p(x) / q(x) > 1 - `tolerance`; at the first token that fails, a token is sampled
    from p and the chain stops. When all are kept the bonus is sampled from `target_probs[γ]`.
    `tolerance` = 0 still is not lossless (it keeps only tokens with p > q and never corrects
    for them); use `rejection_accept` when exactness matters.
    """
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"tau must be in [0, 1], got {tau}")
    if not 0.0 <= tolerance <= 1.0:
        raise ValueError(f"tolerance must be in [0, 1], got {tolerance}")
    draft_ids = _as_ids(draft)
    gamma = len(draft_ids)
    _check_pair(draft_probs, target_probs, gamma)
    p_drafted, q_drafted = _drafted_probs(draft_ids, draft_probs, target_probs)  # [γ], [γ]
    # p / q > 1 - tolerance, written without the division (q > tau >= 0 wherever it matters)
    kept = ((q_drafted > tau) & (p_drafted > (1.0 - tolerance) * q_drafted)).tolist()
    accepted = _leading_true(kept)
    next_token = _draw(target_probs[accepted], generator)
    return Verdict(accepted, (*draft_ids[:accepted], next_token))


# -- helpers --------------------------------------------------------------------------------


def _as_ids(draft: Sequence[int]) -> list[int]:
    return [int(token) for token in draft]


def _check_rows(probs: torch.Tensor, rows: int, name: str) -> None:
    if probs.dim() != 2 or probs.shape[0] != rows:
        raise ValueError(f"{name} must have shape [{rows}, V] for this draft, got {list(probs.shape)}")


def _check_pair(draft_probs: torch.Tensor, target_probs: torch.Tensor, gamma: int) -> None:
    _check_rows(draft_probs, gamma, "draft_probs")
    _check_rows(target_probs, gamma + 1, "target_probs")
    if draft_probs.shape[1] != target_probs.shape[1]:
        raise ValueError(
            f"draft and target vocabularies differ: {draft_probs.shape[1]} vs {target_probs.shape[1]}"
        )
    if draft_probs.device != target_probs.device:
        raise ValueError(f"draft_probs on {draft_probs.device} but target_probs on {target_probs.device}")


def _drafted_probs(
    draft_ids: list[int], draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x_i) and q(x_i) of each drafted token, as float32 on the probabilities' device."""
    vocab = target_probs.shape[1]
    if any(not 0 <= token < vocab for token in draft_ids):
        raise ValueError(f"draft tokens must be in [0, {vocab}), got {draft_ids}")
    device = target_probs.device
    positions = torch.arange(len(draft_ids), device=device)  # [γ]
    ids = torch.tensor(draft_ids, dtype=torch.long, device=device)  # [γ]
    p_drafted = target_probs[positions, ids].float()  # [γ]
    q_drafted = draft_probs[positions, ids].float()  # [γ]
    return p_drafted, q_drafted


def _leading_true(flags: list[bool]) -> int:
    """Length of the run of True at the start of `flags`."""
    for index, flag in enumerate(flags):
        if not flag:
            return index
    return len(flags)


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from non-negative `weights` [V] (need not sum to 1)."""
    return int(torch.multinomial(weights.float(), 1, generator=generator))
