"""The measured search: which points it tries, and that it finds a synthetic model's optimum."""

from __future__ import annotations

import itertools
import threading

import pytest

from engine.errors import GenerationCancelled
from engine.tune.search import candidate_points, certainty, choose, search, summarize
from engine.tune.types import CurvePoint, Prediction

MOE_LAYERS = 10


def _prediction(cutoff_layer: int, draft_len: int, curve_lens: tuple[int, ...] = (2, 4, 6, 8)) -> Prediction:
    cutoffs = range(-1, MOE_LAYERS)
    curve = tuple(CurvePoint(cutoff, length, 1.0) for length in curve_lens for cutoff in cutoffs)
    return Prediction(
        cache_experts=16,
        cutoff_layer=cutoff_layer,
        draft_len=draft_len,
        expected_tpot_ms=1.0,
        expected_tokens_per_s=1000.0,
        curve=curve,
        reasons=(),
    )


def _u_shaped(cutoff: int, draft_len: int, drafter: str = "draft") -> list[float]:
    """Large experts (SP-MoE Fig. 9, Mixtral): TPOT falls, then rises; minimum at (3, 4); no noise."""
    return [10.0 + (cutoff - 3) ** 2 + 0.5 * abs(draft_len - 4)]


def _monotone(cutoff: int, draft_len: int, drafter: str = "draft") -> list[float]:
    """Small experts (DeepSeek): TPOT falls all the way to the last layer; best draft 6."""
    return [30.0 - cutoff + abs(draft_len - 6)]


def test_candidates_span_the_analytic_choice_and_both_ends() -> None:
    points = candidate_points(_prediction(cutoff_layer=2, draft_len=4), MOE_LAYERS)
    assert sorted({cutoff for cutoff, _, _ in points}) == [-1, 0, 1, 2, 3, 4, 9]
    # the prediction and its neighbours, and plain decoding: the baseline, measured once
    assert sorted({length for _, length, _ in points}) == [0, 2, 4, 6]
    assert points[0] == (-1, 0, "") and len(points) == 1 + 7 * 3
    assert {drafter for _, length, drafter in points if length} == {"draft"}
    assert points == sorted(points, key=lambda point: (point[1], point[0]))


def test_candidates_stay_in_range_and_take_given_draft_lengths() -> None:
    points = candidate_points(_prediction(cutoff_layer=-1, draft_len=2), MOE_LAYERS, draft_lens=[5, 3, 5])
    assert points == [(c, d, "draft") for d in (3, 5) for c in (-1, 0, 1, 9)]
    at_end = candidate_points(_prediction(cutoff_layer=9, draft_len=8), MOE_LAYERS, cutoff_span=1)
    assert sorted({c for c, _, _ in at_end}) == [-1, 8, 9]
    assert sorted({d for _, d, _ in at_end}) == [0, 4, 6, 8]  # 8 is the longest considered: shifted inward


def test_candidates_for_plain_decoding_and_unknown_draft_lengths() -> None:
    # no drafter: the prediction's curve is the single plain point
    assert candidate_points(_prediction(-1, 0, curve_lens=(0,)), MOE_LAYERS) == [(-1, 0, "")]
    # plain predicted faster, a drafter measured: plain and the two shortest drafts are measured
    plain_wins = candidate_points(_prediction(cutoff_layer=-1, draft_len=0), MOE_LAYERS)
    assert plain_wins == [(-1, 0, "")] + [(c, d, "draft") for d in (2, 4) for c in (-1, 0, 1, 9)]
    unknown = candidate_points(_prediction(2, 5, curve_lens=()), MOE_LAYERS)
    assert sorted({d for _, d, _ in unknown}) == [0, 3, 5, 7]


def test_every_drafter_that_applies_gets_the_speculative_points_and_plain_is_measured_once() -> None:
    points = candidate_points(_prediction(-1, 0), MOE_LAYERS, drafters=("draft", "self"))
    assert points[0] == (-1, 0, "") and [p for p in points if p[1] == 0] == [(-1, 0, "")]
    assert [p[:2] for p in points if p[2] == "draft"] == [p[:2] for p in points if p[2] == "self"]
    assert len(points) == 1 + 2 * 2 * 4


def test_search_finds_the_bottom_of_a_u_shaped_curve() -> None:
    # the analytic choice (1, 4) is off by two layers; the measured minimum is (3, 4)
    points = candidate_points(_prediction(cutoff_layer=1, draft_len=4), MOE_LAYERS)
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
    point = summarize(2, 4, "self", [7.0, 5.0, 9.0])
    assert point == CurvePoint(2, 4, 7.0, "self", 5.0, 9.0, 3)


def test_noise_between_neighbours_is_measured_again_until_the_choice_is_clear() -> None:
    """A busy machine: each run of a point is off by up to ±40 %; the true best is (1, 4, self)."""
    true_ms = {(0, 4, "self"): 10.0, (1, 4, "self"): 8.0, (2, 4, "self"): 12.0}
    noise = {key: itertools.chain([1.4, 0.9], itertools.repeat(1.0)) for key in true_ms}
    noise[(0, 4, "self")] = itertools.chain([0.6], itertools.repeat(1.0))  # a lucky first run: 6.0 ms
    calls = []

    def measure(cutoff: int, draft_len: int, drafter: str) -> list[float]:
        calls.append((cutoff, draft_len, drafter))
        key = (cutoff, draft_len, drafter)
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
    points = [(-1, 2, "draft"), (0, 2, "draft"), (1, 2, "draft")]
    measured = search(points, _u_shaped, progress=lambda *call: calls.append(call), max_rounds=0)
    assert calls == [(1, 3, measured[0]), (2, 3, measured[1]), (3, 3, measured[2])]
    # cutoff 0, draft 2: 10 + (0 − 3)² + 0.5·2 = 20
    assert measured[1] == CurvePoint(0, 2, 20.0, "draft", 20.0, 20.0, 1)


def test_cancel_stops_between_points() -> None:
    cancel = threading.Event()
    measured_points: list[tuple[int, int]] = []

    def measure(cutoff: int, draft_len: int, drafter: str) -> list[float]:
        measured_points.append((cutoff, draft_len))
        return [1.0]

    def progress(done: int, total: int, point: CurvePoint) -> None:
        if done == 2:
            cancel.set()

    with pytest.raises(GenerationCancelled, match="2 of 4"):
        search(
            [(-1, 2, "draft"), (0, 2, "draft"), (1, 2, "draft"), (2, 2, "draft")], measure, progress, cancel
        )
    assert measured_points == [(-1, 2), (0, 2)]


def test_cancel_before_the_first_point_measures_nothing() -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        search([(-1, 2, "draft")], lambda *point: pytest.fail("measured after cancel"), cancel=cancel)


def test_a_bad_measurement_is_an_error() -> None:
    with pytest.raises(ValueError, match="positive finite"):
        search([(0, 2, "draft")], lambda *point: [float("nan")])


def test_choose_breaks_ties_by_smaller_cutoff_then_shorter_draft() -> None:
    tied = [CurvePoint(3, 4, 5.0), CurvePoint(1, 6, 5.0), CurvePoint(1, 2, 5.0), CurvePoint(0, 2, 6.0)]
    assert choose(tied) == CurvePoint(1, 2, 5.0)
    with pytest.raises(ValueError):
        choose([])
