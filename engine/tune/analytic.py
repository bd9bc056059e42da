"""The papers' models on measured numbers: expert cache size, cutoff layer, draft length, TPOT.

Contract: pure arithmetic on a `Probe` and a `Profile`; no model, no clock, no torch.

Notation: E routed experts per layer, K top-k, L MoE layers, C cached experts (over all
layers), γ draft length, α per-token acceptance rate, t_load the copy time of one expert
(`Profile.expert_load_ms`), N(t) = E·(1 − ((E − K)/E)^t) MoESD's expected distinct experts
that t tokens route to in one layer (`engine.speculative.draft_len.unique_experts`).

Assumptions, stated once:

- Routing is uniform and the cache is spread evenly over the layers, so a fraction
  f = min(1, C / (L·E)) of any layer's experts is resident, and a verify over γ + 1 tokens
  misses m = N(γ + 1)·(1 − f) experts per layer.
- SP-MoE prefetch (layers 0..cutoff, during drafting) predicts m experts per layer and copies
  them all; a fraction r of them (`prefetch_recall`, SP-MoE Fig. 7 reports mostly above 88 %)
  is what verification routes to; the rest of that layer's misses are copied on demand.
- Prefetch copies overlap the draft and are hidden up to the draft time; what is left over,
  and every on-demand copy, is serialised with compute.
- Prefetched experts go into the expert cache's slots, so SP-MoE's memory constraint uses the
  cache less the working set of the layer being verified: (C − ⌈N(γ + 1)⌉)·expert_nbytes.
  The TPOT model itself does not charge for breaking that constraint; `choose_cutoff` keeps it.
"""

from __future__ import annotations

import dataclasses
import math

from engine.errors import BudgetTooSmallError
from engine.speculative.cutoff import CutoffInputs, choose_cutoff
from engine.speculative.draft_len import expected_accept_len, unique_experts
from engine.tune.types import CurvePoint, Prediction, Probe, Profile

PREFETCH_RECALL = 0.88  # share of prefetched experts that verification uses (SP-MoE Fig. 7)


def cache_experts(
    vram_budget_bytes: int, peak_non_expert_bytes: int, expert_nbytes: int, total_experts: int, top_k: int
) -> int:
    """Experts the device cache holds: ⌊(budget − peak) / expert_nbytes⌋, at most `total_experts`.

    Raises `BudgetTooSmallError`, naming the shortfall, when it cannot hold the `top_k` experts
    one token needs in one layer.
    """
    if expert_nbytes < 1 or not 1 <= top_k <= total_experts:
        raise ValueError(
            f"need expert_nbytes >= 1 and 1 <= top_k <= total_experts; got expert_nbytes={expert_nbytes}, "
            f"top_k={top_k}, total_experts={total_experts}"
        )
    free_bytes = vram_budget_bytes - peak_non_expert_bytes
    slots = max(0, free_bytes) // expert_nbytes
    if slots < top_k:
        needed = peak_non_expert_bytes + top_k * expert_nbytes
        raise BudgetTooSmallError(
            f"The VRAM budget of {_size(vram_budget_bytes)} leaves {_size(max(0, free_bytes))} after the "
            f"measured peak of {_size(peak_non_expert_bytes)} for everything but the experts; the expert "
            f"cache needs room for at least {top_k} experts ({_size(top_k * expert_nbytes)}), "
            f"{_size(needed - vram_budget_bytes)} short. Raise the budget to {_size(needed)} or more, "
            f"or choose a shorter context or a smaller precision."
        )
    return min(slots, total_experts)


def cached_fraction(profile: Profile, cache_experts: int) -> float:
    """f: the share of one layer's experts resident, with the cache spread evenly over layers."""
    return min(1.0, cache_experts / (profile.moe_layers * profile.num_experts))


def misses_per_layer(profile: Profile, cache_experts: int, tokens: int) -> float:
    """m = N(tokens)·(1 − f): experts a forward over `tokens` tokens copies per MoE layer.

    N is the profile's measured unique experts of `tokens` consecutive tokens when it has
    them (real text reuses experts from token to token), else MoESD's uniform N(t)."""
    return unique_needed(profile, tokens) * (1.0 - cached_fraction(profile, cache_experts))


def unique_needed(profile: Profile, tokens: int) -> float:
    measured = profile.unique_experts_measured
    if measured and 1 <= tokens <= len(measured):
        return measured[tokens - 1]
    return unique_experts(profile.num_experts, profile.top_k, tokens)


def predict_plain_tpot(profile: Profile, probe: Probe, cache_experts: int) -> float:
    """Plain decoding, one token per step, misses copied on demand:

    TPOT = verify_ms(1) + L · N(1)·(1 − f) · t_load        (N(1) = K)

    `probe` is the machine `profile` was measured on; its link is already in t_load.
    """
    misses = misses_per_layer(profile, cache_experts, 1)
    return _verify_ms(profile, 1) + profile.moe_layers * misses * profile.expert_load_ms


def predict_tpot(
    profile: Profile,
    probe: Probe,
    cache_experts: int,
    cutoff_layer: int,
    draft_len: int,
    *,
    prefetch_recall: float = PREFETCH_RECALL,
) -> float:
    """Predicted ms per generated token of speculative decoding with SP-MoE prefetch.

    One cycle drafts γ tokens, then verifies γ + 1 in one target forward; it emits
    E[len] = (1 − α^(γ+1)) / (1 − α) tokens on average (MoESD). With m = N(γ + 1)·(1 − f),
    P = cutoff + 1 prefetched layers and r = `prefetch_recall`:

        draft     = γ · draft_token_ms
        prefetch  = P · m · t_load                          copied while drafting
        exposed   = max(0, prefetch − draft)                the part the draft cannot hide
        on_demand = ((L − P) + P·(1 − r)) · m · t_load       serialised with compute
        TPOT      = (draft + verify_ms(γ + 1) + exposed + on_demand) / E[len]

    Within the draft time each prefetched layer saves r·m·t_load; past it, each costs
    (1 − r)·m·t_load more than no prefetch, hence SP-MoE's U-shaped TPOT-vs-cutoff curve when
    copies are slow, and a monotone one when the whole model's copies fit in the draft.
    With γ = 0 or no drafter (no draft time or no acceptance rate) it is `predict_plain_tpot`.
    """
    if draft_len == 0 or profile.draft_token_ms is None or profile.acceptance_rate is None:
        return predict_plain_tpot(profile, probe, cache_experts)
    if draft_len < 0 or not -1 <= cutoff_layer < profile.moe_layers:
        raise ValueError(
            f"need draft_len >= 0 and -1 <= cutoff_layer < {profile.moe_layers}; "
            f"got draft_len={draft_len}, cutoff_layer={cutoff_layer}"
        )
    if not 0.0 <= prefetch_recall <= 1.0:
        raise ValueError(f"prefetch_recall must be in [0, 1], got {prefetch_recall}")
    misses = misses_per_layer(profile, cache_experts, draft_len + 1)
    layer_copy_ms = misses * profile.expert_load_ms
    prefetched_layers = cutoff_layer + 1
    draft_ms = draft_len * profile.draft_token_ms
    exposed_ms = max(0.0, prefetched_layers * layer_copy_ms - draft_ms)
    on_demand_layers = (profile.moe_layers - prefetched_layers) + prefetched_layers * (1.0 - prefetch_recall)
    cycle_ms = draft_ms + _verify_ms(profile, draft_len + 1) + exposed_ms + on_demand_layers * layer_copy_ms
    return cycle_ms / expected_accept_len(profile.acceptance_rate, draft_len)


def cutoff_inputs(profile: Profile, cache_experts: int, draft_len: int) -> CutoffInputs:
    """SP-MoE's cutoff inputs for draft length γ (see the module docstring for the memory rule)."""
    if profile.draft_token_ms is None:
        raise ValueError("the cutoff layer needs a drafter's measured draft time")
    working_set = math.ceil(unique_needed(profile, draft_len + 1))
    return CutoffInputs(
        moe_layers=profile.moe_layers,
        experts_per_layer=misses_per_layer(profile, cache_experts, draft_len + 1),
        expert_nbytes=profile.expert_nbytes,
        free_nbytes=max(0, cache_experts - working_set) * profile.expert_nbytes,
        t_load_ms=profile.expert_load_ms,
        draft_ms=draft_len * profile.draft_token_ms,
    )


def predict(
    profile: Profile,
    probe: Probe,
    vram_budget_bytes: int,
    draft_lens: tuple[int, ...] = (2, 4, 6, 8),
    *,
    prefetch_recall: float = PREFETCH_RECALL,
) -> Prediction:
    """Cache size, and for each drafter measured (`Profile.drafters`) the SP-MoE cutoff per draft
    length and its best draft length; the prediction is the fastest of them and plain decoding.

    `curve` holds plain decoding's point and, per drafter, the predicted TPOT for every cutoff
    −1..L−1 and every draft length, labelled with the drafter. Ties go to plain decoding, then
    to the drafter measured first, then to the shorter draft.
    """
    total = profile.moe_layers * profile.num_experts
    cache = cache_experts(
        vram_budget_bytes, profile.peak_non_expert_bytes, profile.expert_nbytes, total, profile.top_k
    )
    plain_ms = predict_plain_tpot(profile, probe, cache)
    reasons = [_cache_reason(profile, probe, vram_budget_bytes, cache)]
    curve = [CurvePoint(-1, 0, plain_ms)]
    drafters = drafter_profiles(profile)
    if not drafters:
        reasons.append(f"No drafter measured: plain decoding, {plain_ms:.1f} ms per token predicted.")
        return _prediction(cache, -1, 0, plain_ms, tuple(curve), reasons)
    if not draft_lens or any(draft_len < 1 for draft_len in draft_lens):
        raise ValueError(f"draft_lens must be a non-empty set of lengths >= 1, got {draft_lens}")
    best = (plain_ms, -1, 0, "")
    stops = {d.name: d.drafted_len / d.draft_len for d in profile.drafters if d.drafted_len}
    for name, drafter in drafters:
        lens, stop = sorted(set(draft_lens)), stops.get(name, 1.0)
        ms, cutoff, draft_len, points, reason = _drafter_curve(
            drafter, probe, cache, lens, prefetch_recall, plain_ms, stop
        )
        curve += [dataclasses.replace(point, drafter=name) for point in points]
        words = _DRAFTER_NAMES.get(name, name)
        reasons.append(f"{words[:1].upper()}{words[1:]}: {reason}")
        if ms < best[0]:
            best = (ms, cutoff, draft_len, name)
    return _prediction(cache, best[1], best[2], best[0], tuple(curve), reasons, best[3])


_DRAFTER_NAMES = {
    "draft": "the draft model",
    "self": "self-speculation (the model with fewer experts per token)",
    "substitute": "substitute experts (low-bit copies kept on the device)",
    "mtp": "the checkpoint's multi-token-prediction layer",
}


def drafter_profiles(profile: Profile) -> list[tuple[str, Profile]]:
    """(name, `profile` with that drafter's cost and acceptance) for every drafter measured; a
    profile with only the single drafter fields (older results) is one drafter, "draft"."""
    if profile.drafters:
        return [
            (
                d.name,
                dataclasses.replace(profile, draft_token_ms=d.token_ms, acceptance_rate=d.acceptance_rate),
            )
            for d in profile.drafters
        ]
    if profile.draft_token_ms is None or profile.acceptance_rate is None:
        return []
    return [("draft", profile)]


def _drafter_curve(
    profile: Profile,
    probe: Probe,
    cache: int,
    draft_lens: list[int],
    recall: float,
    plain_ms: float,
    stop: float = 1.0,
) -> tuple[float, int, int, list[CurvePoint], str]:
    """One drafter's best (TPOT, cutoff, draft length), its curve and why, in one sentence. `stop`:
    the share of a draft length the drafter drafts, as measured with the confidence stop (`--tau`)
    ending drafts early; a length γ is predicted as the γ·stop tokens it drafts."""

    def drafted(draft_len: int) -> int:
        return max(1, min(draft_len, round(draft_len * stop)))

    def tpot(cutoff_layer: int, draft_len: int) -> float:
        return predict_tpot(profile, probe, cache, cutoff_layer, drafted(draft_len), prefetch_recall=recall)

    cutoffs = {n: choose_cutoff(cutoff_inputs(profile, cache, drafted(n))) for n in draft_lens}
    best_len = min(draft_lens, key=lambda draft_len: tpot(cutoffs[draft_len].layer, draft_len))
    best_ms = tpot(cutoffs[best_len].layer, best_len)
    points = [
        CurvePoint(cutoff_layer, draft_len, tpot(cutoff_layer, draft_len))
        for draft_len in draft_lens
        for cutoff_layer in range(-1, profile.moe_layers)
    ]
    reason = _draft_reason(profile, drafted(best_len), best_ms, plain_ms)
    if drafted(best_len) < best_len:
        reason += f" The confidence stop ends its drafts of {best_len} at about {drafted(best_len)} tokens."
    if best_ms <= plain_ms:
        reason += f" Cutoff layer: {cutoffs[best_len].reason}"
    return best_ms, cutoffs[best_len].layer, best_len, points, reason


def _prediction(
    cache: int,
    cutoff_layer: int,
    draft_len: int,
    tpot_ms: float,
    curve: tuple[CurvePoint, ...],
    reasons: list[str],
    drafter: str = "",
) -> Prediction:
    return Prediction(
        cache_experts=cache,
        cutoff_layer=cutoff_layer,
        draft_len=draft_len,
        expected_tpot_ms=tpot_ms,
        expected_tokens_per_s=1000.0 / tpot_ms,
        curve=curve,
        reasons=tuple(reasons),
        drafter=drafter,
    )


def _verify_ms(profile: Profile, tokens: int) -> float:
    """The measured target forward over `tokens` tokens, experts resident."""
    if not 1 <= tokens <= len(profile.verify_ms):
        raise ValueError(
            f"verify time was measured for 1–{len(profile.verify_ms)} tokens, not {tokens}; "
            f"choose a draft length of at most {len(profile.verify_ms) - 1}"
        )
    return profile.verify_ms[tokens - 1]


def _cache_reason(profile: Profile, probe: Probe, budget: int, cache: int) -> str:
    total = profile.moe_layers * profile.num_experts
    link = f"{probe.h2d_gbps:.3g} GB/s{' (simulated)' if probe.simulated_link else ''}"
    return (
        f"Expert cache: {cache} of {total} experts ({_size(cache * profile.expert_nbytes)}) fit in the "
        f"{_size(budget)} budget after the measured peak of {_size(profile.peak_non_expert_bytes)}; "
        f"{100 * cached_fraction(profile, cache):.0f}% of each layer's experts stay resident, the rest "
        f"are copied in {profile.expert_load_ms:.2f} ms each over a {link} link."
    )


def _draft_reason(profile: Profile, best_len: int, best_ms: float, plain_ms: float) -> str:
    alpha = profile.acceptance_rate or 0.0
    accept = expected_accept_len(alpha, best_len)
    if plain_ms < best_ms:
        return (
            f"Plain decoding ({plain_ms:.1f} ms per token) is predicted faster than speculative "
            f"decoding at its best draft length {best_len} ({best_ms:.1f} ms; acceptance rate "
            f"{alpha:.2f}, {accept:.2f} tokens per verify)."
        )
    return (
        f"Draft length {best_len}: {accept:.2f} tokens per verify at acceptance rate {alpha:.2f}, "
        f"{best_ms:.1f} ms per token predicted against {plain_ms:.1f} ms for plain decoding."
    )


def _size(nbytes: float) -> str:
    if abs(nbytes) >= 1 << 30:
        return f"{nbytes / (1 << 30):.2f} GiB"
    return f"{nbytes / (1 << 20):.1f} MiB"
