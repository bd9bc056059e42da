"""The measured search: which points it tries, and that it finds a synthetic model's optimum."""

from __future__ import annotations

import dataclasses
import itertools
import threading

import pytest

from engine.errors import GenerationCancelled
from engine.tune.search import (
    PLAIN,
    Setting,
    candidate_points,
    certainty,
    choose,
    explain,
    policy_points,
    search,
    summarize,
)
from engine.tune.types import CurvePoint, Prediction

MOE_LAYERS = 10


def _prediction(
    cutoff_layer: int, draft_len: int, curve_lens: tuple[int, ...] = (2, 4, 6, 8), drafters=("",)
) -> Prediction:
    """A prediction whose curve, for each drafter, is fastest at (cutoff_layer, draft_len)."""
    cutoffs = range(-1, MOE_LAYERS)
    curve = [CurvePoint(-1, 0, 50.0)]
    curve += [
        CurvePoint(cutoff, length, 1.0 + abs(cutoff - cutoff_layer) + abs(length - draft_len), drafter)
        for drafter in drafters
        for length in curve_lens
        for cutoff in cutoffs
    ]
    return Prediction(
        cache_experts=16,
        cutoff_layer=cutoff_layer,
        draft_len=draft_len,
        expected_tpot_ms=1.0,
        expected_tokens_per_s=1000.0,
        curve=tuple(curve),
        reasons=(),
    )


def _u_shaped(point: Setting) -> list[float]:
    """Large experts (SP-MoE Fig. 9, Mixtral): TPOT falls, then rises; minimum at (3, 4); no noise."""
    return [10.0 + (point.cutoff_layer - 3) ** 2 + 0.5 * abs(point.draft_len - 4)]


def _monotone(point: Setting) -> list[float]:
    """Small experts (DeepSeek): TPOT falls all the way to the last layer; best draft 6."""
    return [30.0 - point.cutoff_layer + abs(point.draft_len - 6)]


def test_candidates_span_each_drafters_predicted_best_and_both_ends() -> None:
    points = candidate_points(_prediction(cutoff_layer=2, draft_len=4), MOE_LAYERS)
    assert points[0] == PLAIN and [p for p in points if p.draft_len == 0] == [PLAIN]
    # at the predicted draft length: the cutoff ± 1 and both ends; at the predicted cutoff: the
    # neighbouring lengths among those the curve considered
    assert [(p.cutoff_layer, p.draft_len) for p in points[1:]] == [(c, 4) for c in (-1, 1, 2, 3, 9)] + [
        (2, 2),
        (2, 6),
    ]
    assert {p.drafter for p in points[1:]} == {"draft"}
    wide = candidate_points(_prediction(cutoff_layer=2, draft_len=4), MOE_LAYERS, cutoff_span=2)
    assert sorted({p.cutoff_layer for p in wide if p.draft_len == 4}) == [-1, 0, 1, 2, 3, 4, 9]


def test_candidates_stay_in_range_at_the_ends() -> None:
    at_end = candidate_points(_prediction(cutoff_layer=9, draft_len=8), MOE_LAYERS)
    assert sorted({p.cutoff_layer for p in at_end[1:]}) == [-1, 8, 9]
    assert sorted({p.draft_len for p in at_end}) == [0, 6, 8]  # 8 is the longest considered
    at_start = candidate_points(_prediction(cutoff_layer=-1, draft_len=2), MOE_LAYERS)
    assert sorted({p.cutoff_layer for p in at_start[1:]}) == [-1, 0, 9]


def test_a_speculative_point_is_measured_even_where_plain_decoding_is_predicted_faster() -> None:
    """The root of a tune that measured only plain decoding: the points come from each drafter's
    own curve, not from the overall prediction."""
    plain_wins = dataclasses.replace(_prediction(cutoff_layer=3, draft_len=6), cutoff_layer=-1, draft_len=0)
    points = candidate_points(plain_wins, MOE_LAYERS, drafters=("self",))
    assert {(p.cutoff_layer, p.draft_len, p.drafter) for p in points if p.draft_len == 6} == {
        (c, 6, "self") for c in (-1, 2, 3, 4, 9)
    }
    # no drafter profiled: plain decoding alone; a drafter missing from the curve is not measured
    assert candidate_points(_prediction(-1, 0, curve_lens=()), MOE_LAYERS) == [PLAIN]
    labelled = _prediction(2, 4, drafters=("self",))
    assert {p.drafter for p in candidate_points(labelled, MOE_LAYERS, drafters=("draft", "self"))} == {
        "",
        "self",
    }


def test_every_drafter_gets_the_points_around_its_own_best() -> None:
    two = _prediction(2, 4, drafters=("draft",))
    other = _prediction(5, 8, drafters=("mtp",))
    both = dataclasses.replace(two, curve=two.curve + other.curve[1:])
    points = candidate_points(both, MOE_LAYERS, drafters=("draft", "mtp"))
    assert {p.draft_len for p in points if p.drafter == "draft"} == {2, 4, 6}
    assert {p.cutoff_layer for p in points if p.drafter == "mtp" and p.draft_len == 8} == {-1, 4, 5, 6, 9}


def test_the_leaders_other_policies() -> None:
    leader = Setting(3, 4, "self")
    cpu = policy_points(leader, on_gpu=False, loaded_policy="lru")
    assert cpu == [
        Setting(-1, 4, "self", "next-layer"),
        Setting(3, 4, "self", policy="lfu"),
        Setting(3, 4, "self", policy="mrs"),
    ]
    gpu = policy_points(leader, on_gpu=True, loaded_policy="mrs")
    assert Setting(3, 4, "self", cpu_experts="auto") in gpu and Setting(3, 4, "self", policy="lru") in gpu


def test_search_measures_the_leaders_policies_after_the_first_pass() -> None:
    def measure(point: Setting) -> list[float]:
        return [_u_shaped(point)[0] - (1.0 if point.policy == "mrs" else 0.0)]

    points = candidate_points(_prediction(cutoff_layer=3, draft_len=4), MOE_LAYERS)
    measured = search(points, measure, then=lambda leader: policy_points(leader, False, "lru"))
    best = choose(measured)
    assert (best.cutoff_layer, best.draft_len, best.policy) == (3, 4, "mrs")
    assert "MRS cache" in explain(measured) and "plain decoding" in explain(measured)


def test_search_finds_the_bottom_of_a_u_shaped_curve() -> None:
    # the analytic choice (1, 4) is off by two layers; the measured minimum is (3, 4)
    points = candidate_points(_prediction(cutoff_layer=2, draft_len=4), MOE_LAYERS)
    measured = search(points, _u_shaped)
    assert len(measured) == len(points)
    best = choose(measured)
    assert (best.cutoff_layer, best.draft_len, best.tpot_ms) == (3, 4, 10.0)


def test_search_finds_the_end_of_a_monotone_curve() -> None:
    # the analytic choice stops at layer 2 (say, by memory); the last layer is still measured
    points = candidate_points(_prediction(cutoff_layer=2, draft_len=6), MOE_LAYERS)
    best = choose(search(points, _monotone))
    assert (best.cutoff_layer, best.draft_len, best.tpot_ms) == (9, 6, 21.0)


def test_a_point_is_the_median_of_its_runs_with_their_spread() -> None:
    point = summarize(Setting(2, 4, "self"), [7.0, 5.0, 9.0])
    assert point == CurvePoint(2, 4, 7.0, "self", 5.0, 9.0, 3)


def test_noise_between_neighbours_is_measured_again_until_the_choice_is_clear() -> None:
    """A busy machine: each run of a point is off by up to ±40 %; the true best is (1, 4, self)."""
    true_ms = {Setting(0, 4, "self"): 10.0, Setting(1, 4, "self"): 8.0, Setting(2, 4, "self"): 12.0}
    noise = {key: itertools.chain([1.4, 0.9], itertools.repeat(1.0)) for key in true_ms}
    noise[Setting(0, 4, "self")] = itertools.chain([0.6], itertools.repeat(1.0))  # a lucky first run
    calls = []

    def measure(key: Setting) -> list[float]:
        calls.append(key)
        return [true_ms[key] * next(noise[key]), true_ms[key] * next(noise[key])]

    measured = search(list(true_ms), measure, max_rounds=3)
    assert len(calls) > len(true_ms), "the two overlapping best were measured again"
    best = choose(measured)
    assert (best.cutoff_layer, best.drafter) == (1, "self") and best.runs > 2
    assert certainty(measured).startswith("Sure")


def test_the_certainty_says_when_the_best_two_are_within_noise() -> None:
    close = [CurvePoint(1, 4, 8.0, "self", 7.0, 9.5, 6), CurvePoint(0, 4, 8.4, "draft", 7.5, 9.0, 6)]
    assert certainty(close).startswith("Close call") and "the draft model" in certainty(close)
    apart = [CurvePoint(1, 4, 8.0, "self", 7.8, 8.2, 2), CurvePoint(-1, 0, 12.0, "", 11.5, 12.5, 2)]
    assert certainty(apart).startswith("Sure: 33% faster") and "plain decoding" in certainty(apart)


def test_progress_after_every_point() -> None:
    calls: list[tuple[int, int, CurvePoint]] = []
    points = [Setting(-1, 2, "draft"), Setting(0, 2, "draft"), Setting(1, 2, "draft")]
    measured = search(points, _u_shaped, progress=lambda *call: calls.append(call), max_rounds=0)
    assert calls == [(1, 3, measured[0]), (2, 3, measured[1]), (3, 3, measured[2])]
    # cutoff 0, draft 2: 10 + (0 − 3)² + 0.5·2 = 20
    assert measured[1] == CurvePoint(0, 2, 20.0, "draft", 20.0, 20.0, 1)


def test_cancel_stops_between_points() -> None:
    cancel = threading.Event()
    measured_points: list[tuple[int, int]] = []

    def measure(point: Setting) -> list[float]:
        measured_points.append(point[:2])
        return [1.0]

    def progress(done: int, total: int, point: CurvePoint) -> None:
        if done == 2:
            cancel.set()

    with pytest.raises(GenerationCancelled, match="2 of 4"):
        search([Setting(c, 2, "draft") for c in (-1, 0, 1, 2)], measure, progress, cancel)
    assert measured_points == [(-1, 2), (0, 2)]


def test_cancel_before_the_first_point_measures_nothing() -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        search([Setting(-1, 2, "draft")], lambda point: pytest.fail("measured after cancel"), cancel=cancel)


def test_a_bad_measurement_is_an_error() -> None:
    with pytest.raises(ValueError, match="positive finite"):
        search([Setting(0, 2, "draft")], lambda point: [float("nan")])


def test_choose_breaks_ties_by_smaller_cutoff_then_shorter_draft() -> None:
    tied = [CurvePoint(3, 4, 5.0), CurvePoint(1, 6, 5.0), CurvePoint(1, 2, 5.0), CurvePoint(0, 2, 6.0)]
    assert choose(tied) == CurvePoint(1, 2, 5.0)
    with pytest.raises(ValueError):
        choose([])
