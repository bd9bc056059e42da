"""The analytic tune models against values worked out by hand (arithmetic in the comments).

The profile: L = 4 MoE layers, E = 8 experts, K = 2, 1 MiB experts, t_load = 2 ms,
draft token 4 ms, verify_ms(t) = 9 + t, peak non-expert memory 100 MiB.
N(t) = 8·(1 − 0.75^t): N(1) = 2, N(3) = 8·(1 − 0.421875) = 4.625,
N(5) = 8·(1 − 0.2373046875) = 6.1015625.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from engine.errors import BudgetTooSmallError
from engine.tune.analytic import (
    cache_experts,
    cutoff_inputs,
    misses_per_layer,
    predict,
    predict_plain_tpot,
    predict_tpot,
)
from engine.tune.types import CurvePoint, DrafterProfile, Probe, Profile

MIB = 1 << 20

PROBE = Probe(
    device_kind="cpu",
    gpu_name=None,
    gpu_uuid=None,
    vram_total_bytes=None,
    vram_free_bytes=None,
    pcie_gen_max=None,
    pcie_gen_current=None,
    pcie_width_max=None,
    pcie_width_current=None,
    h2d_gbps=16.0,
    h2d_latency_us=10.0,
    simulated_link=True,
    cpu_cores=8,
    ram_total_bytes=32 << 30,
    ram_available_bytes=16 << 30,
    cpu_expert_ms=None,
    note="No GPU: simulated link",
)

PROFILE = Profile(
    model="/models/tiny",
    model_type="qwen3_moe",
    moe_layers=4,
    num_experts=8,
    top_k=2,
    expert_nbytes=MIB,
    target_layer_ms=1.0,
    draft_token_ms=4.0,
    expert_load_ms=2.0,
    verify_ms=tuple(9.0 + tokens for tokens in range(1, 17)),
    non_expert_bytes=80 * MIB,
    kv_bytes_per_token=1024,
    context_tokens=4096,
    peak_non_expert_bytes=100 * MIB,
    acceptance_rate=0.5,
)


def test_cache_experts_is_the_budget_left_after_the_peak() -> None:
    # (110.9 MiB − 100 MiB) / 1 MiB = 10.9 → 10 whole experts
    assert cache_experts(int(110.9 * MIB), 100 * MIB, MIB, 32, 2) == 10


def test_cache_experts_never_exceeds_all_experts() -> None:
    # 1 GiB − 100 MiB holds 924 experts, but the model has only 32
    assert cache_experts(1 << 30, 100 * MIB, MIB, 32, 2) == 32


def test_cache_experts_names_the_shortfall() -> None:
    # 101.5 MiB − 100 MiB holds 1 expert < top_k = 2; needs 102 MiB, 0.5 MiB short
    with pytest.raises(BudgetTooSmallError, match=r"0\.5 MiB short.*102\.0 MiB"):
        cache_experts(int(101.5 * MIB), 100 * MIB, MIB, 32, 2)
    with pytest.raises(BudgetTooSmallError, match=r"leaves 0\.0 MiB"):
        cache_experts(50 * MIB, 100 * MIB, MIB, 32, 2)


def test_plain_tpot() -> None:
    # f = 8 / (4·8) = 0.25; misses per layer N(1)·0.75 = 1.5; copies 4 · 1.5 · 2 ms = 12 ms
    # TPOT = verify_ms(1) + 12 = 10 + 12 = 22 ms
    assert predict_plain_tpot(PROFILE, PROBE, 8) == pytest.approx(22.0)
    # a full cache misses nothing: TPOT = verify_ms(1) = 10 ms
    assert predict_plain_tpot(PROFILE, PROBE, 32) == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("cutoff", "expected"),
    [
        # γ = 2, C = 8, r = 0.5: m = N(3)·0.75 = 3.46875, one layer's copies 6.9375 ms,
        # draft 2·4 = 8 ms, verify_ms(3) = 12 ms, E[len] = (1 − 0.5³)/0.5 = 1.75
        # cutoff −1: on demand 4·6.9375 = 27.75; (8 + 12 + 27.75) / 1.75
        (-1, 47.75 / 1.75),
        # cutoff 0: prefetch 6.9375 < 8 hidden; on demand (3 + 0.5)·6.9375 = 24.28125
        (0, (8 + 12 + 24.28125) / 1.75),
        # cutoff 1: prefetch 13.875, exposed 5.875; on demand (2 + 1)·6.9375 = 20.8125
        (1, (8 + 12 + 5.875 + 20.8125) / 1.75),
        # cutoff 3: prefetch 27.75, exposed 19.75; on demand (0 + 2)·6.9375 = 13.875
        (3, (8 + 12 + 19.75 + 13.875) / 1.75),
    ],
)
def test_speculative_tpot(cutoff: int, expected: float) -> None:
    assert predict_tpot(PROFILE, PROBE, 8, cutoff, 2, prefetch_recall=0.5) == pytest.approx(expected)


def test_tpot_vs_cutoff_is_u_shaped_for_slow_copies() -> None:
    curve = [predict_tpot(PROFILE, PROBE, 8, cutoff, 2, prefetch_recall=0.5) for cutoff in range(-1, 4)]
    assert min(range(5), key=curve.__getitem__) == 1  # cutoff 0, the last layer hidden by the draft
    assert curve[0] > curve[1] < curve[2] < curve[3] < curve[4]


def test_tpot_vs_cutoff_is_monotone_for_fast_copies() -> None:
    # t_load 0.1 ms: all four layers' copies 4·0.346875 = 1.3875 ms fit in the 8 ms draft
    fast = dataclasses.replace(PROFILE, expert_load_ms=0.1)
    curve = [predict_tpot(fast, PROBE, 8, cutoff, 2, prefetch_recall=0.5) for cutoff in range(-1, 4)]
    assert all(later < earlier for earlier, later in itertools.pairwise(curve))


def test_no_drafter_or_no_draft_is_plain_decoding() -> None:
    no_drafter = dataclasses.replace(PROFILE, draft_token_ms=None, acceptance_rate=None)
    assert predict_tpot(no_drafter, PROBE, 8, 2, 4) == pytest.approx(22.0)
    assert predict_tpot(PROFILE, PROBE, 8, -1, 0) == pytest.approx(22.0)


def test_tpot_rejects_what_was_not_measured() -> None:
    with pytest.raises(ValueError, match="cutoff_layer"):
        predict_tpot(PROFILE, PROBE, 8, 4, 2)
    with pytest.raises(ValueError, match="1–16 tokens, not 17"):
        predict_tpot(PROFILE, PROBE, 8, 0, 16)


def test_cutoff_inputs() -> None:
    # C = 24: f = 0.75, γ = 2: m = 4.625·0.25 = 1.15625; working set ⌈4.625⌉ = 5 → 19 free slots
    inputs = cutoff_inputs(PROFILE, 24, 2)
    assert inputs.experts_per_layer == pytest.approx(1.15625)
    assert inputs.free_nbytes == 19 * MIB
    assert inputs.draft_ms == pytest.approx(8.0)
    assert inputs.t_load_ms == 2.0


def test_predict_chooses_draft_length_and_cutoff() -> None:
    # budget 124 MiB → C = 24, f = 0.75; α = 0.8, r = 0.5
    profile = dataclasses.replace(PROFILE, acceptance_rate=0.8)
    prediction = predict(profile, PROBE, 124 * MIB, draft_lens=(2, 4), prefetch_recall=0.5)
    assert prediction.cache_experts == 24
    # γ = 2: one layer's copies 1.15625·2 = 2.3125 ms; time: (L+1)·2.3125 <= 8 → L = 2;
    # memory: 4·1.15625 <= 19 slots → any L. Cycle 8 + 12 + (1 + 3·0.5)·2.3125 = 25.78125,
    # E[len] = (1 − 0.8³)/0.2 = 2.44 → 10.566 ms.
    # γ = 4: m = 6.1015625·0.25 = 1.525390625, copies 3.05078125 ms/layer; time: all 4 layers
    # (12.2 <= 16); cycle 16 + 14 + 4·0.5·3.05078125 = 36.1015625, E[len] = 3.3616 → 10.739 ms.
    assert prediction.draft_len == 2
    assert prediction.cutoff_layer == 2
    assert prediction.expected_tpot_ms == pytest.approx(25.78125 / 2.44)
    assert prediction.expected_tokens_per_s == pytest.approx(1000 * 2.44 / 25.78125)
    assert len(prediction.curve) == 1 + 2 * 5  # plain, then cutoffs −1..3 for each draft length
    assert prediction.curve[0] == CurvePoint(-1, 0, 14.0) and prediction.drafter == "draft"
    gamma2 = [point for point in prediction.curve if point.draft_len == 2]
    assert min(gamma2, key=lambda point: point.tpot_ms).cutoff_layer == 2  # curve agrees with the rule
    assert any("Draft length 2" in reason for reason in prediction.reasons)
    assert any("Cutoff layer" in reason for reason in prediction.reasons)


def test_predict_prefers_plain_decoding_when_drafts_are_rarely_accepted() -> None:
    # α = 0.5: γ = 2 gives 25.78125 / 1.75 = 14.73 ms; plain: 10 + 4·(2·0.25)·2 = 14 ms
    prediction = predict(PROFILE, PROBE, 124 * MIB, draft_lens=(2, 4), prefetch_recall=0.5)
    assert (prediction.draft_len, prediction.cutoff_layer) == (0, -1)
    assert prediction.expected_tpot_ms == pytest.approx(14.0)
    assert any("Plain decoding" in reason for reason in prediction.reasons)


def test_each_drafter_has_its_own_curve_and_the_fastest_wins() -> None:
    """Two drafters measured: the draft model as above (10.57 ms at γ = 2) and a cheaper one the
    target accepts as often (α = 0.8, 1 ms a token); each drafter's points are labelled with it,
    the prediction is the cheaper one's, and a reason is given for each."""
    draft = DrafterProfile("draft", 4.0, 0.8, 4, 3.0)
    cheap = DrafterProfile("self", 1.0, 0.8, 4, 3.0)
    profile = dataclasses.replace(PROFILE, drafters=(draft, cheap))
    prediction = predict(profile, PROBE, 124 * MIB, draft_lens=(2, 4), prefetch_recall=0.5)
    by_drafter = {name: [p for p in prediction.curve if p.drafter == name] for name in ("draft", "self")}
    assert len(by_drafter["draft"]) == len(by_drafter["self"]) == 2 * 5
    alone = predict(
        dataclasses.replace(PROFILE, acceptance_rate=0.8), PROBE, 124 * MIB, (2, 4), prefetch_recall=0.5
    )
    assert [p.tpot_ms for p in by_drafter["draft"]] == [p.tpot_ms for p in alone.curve[1:]]
    # a cheaper draft hides fewer copies, but never costs more than it saves
    assert all(s.tpot_ms <= d.tpot_ms for s, d in zip(by_drafter["self"], by_drafter["draft"], strict=True))
    assert prediction.drafter == "self" and prediction.expected_tpot_ms == min(
        p.tpot_ms for p in by_drafter["self"]
    )
    assert (
        sum(reason.startswith(("The draft model", "Self-speculation")) for reason in prediction.reasons) == 2
    )


def test_predict_without_a_drafter() -> None:
    no_drafter = dataclasses.replace(PROFILE, draft_token_ms=None, acceptance_rate=None)
    prediction = predict(no_drafter, PROBE, 124 * MIB)
    assert (prediction.draft_len, prediction.cutoff_layer) == (0, -1)
    assert [(p.cutoff_layer, p.draft_len) for p in prediction.curve] == [(-1, 0)]
    assert prediction.expected_tokens_per_s == pytest.approx(1000 / 14.0)


def test_predict_reports_a_budget_too_small() -> None:
    with pytest.raises(BudgetTooSmallError):
        predict(PROFILE, PROBE, 100 * MIB)


def test_measured_routing_overlap_replaces_the_uniform_model() -> None:
    # L=4, E=8, K=2, C=8 cached: f = 8 / 32 = 0.25. Uniform N(3) = 8·(1 − (6/8)³) = 4.625,
    # measured N(3) = 3.0 → m = 3.0 · 0.75 = 2.25; beyond the measured range the uniform N(t).
    measured = dataclasses.replace(PROFILE, unique_experts_measured=(2.0, 2.5, 3.0))
    assert misses_per_layer(PROFILE, 8, 3) == pytest.approx(4.625 * 0.75)
    assert misses_per_layer(measured, 8, 3) == pytest.approx(2.25)
    assert misses_per_layer(measured, 8, 4) == pytest.approx(misses_per_layer(PROFILE, 8, 4))


def test_the_confidence_stop_is_in_the_prediction() -> None:
    """A drafter whose drafts the confidence stop (`--tau`) ends at half their length, as profiled:
    a draft length of 4 is predicted as the 2 tokens it drafts."""
    full = DrafterProfile("self", 1.0, 0.8, 4, 3.0)
    stopped = DrafterProfile("self", 1.0, 0.8, 4, 2.5, drafted_len=2.0)
    lens = (2, 4)
    whole = predict(
        dataclasses.replace(PROFILE, drafters=(full,)), PROBE, 124 * MIB, lens, prefetch_recall=0.5
    )
    halved = predict(
        dataclasses.replace(PROFILE, drafters=(stopped,)), PROBE, 124 * MIB, lens, prefetch_recall=0.5
    )

    def at(prediction, draft_len: int) -> list[float]:
        return [p.tpot_ms for p in prediction.curve if p.draft_len == draft_len]

    assert at(halved, 4) == at(whole, 2) != at(whole, 4)
    assert any("confidence stop ends its drafts" in reason for reason in halved.reasons)
