"""The measured search: which points it tries, and that it finds a synthetic model's optimum."""

from __future__ import annotations

import threading

import pytest

from engine.errors import GenerationCancelled
from engine.tune.search import candidate_points, choose, search
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


def _u_shaped(cutoff: int, draft_len: int) -> float:
    """Large experts (SP-MoE Fig. 9, Mixtral): TPOT falls, then rises; minimum at (3, 4)."""
    return 10.0 + (cutoff - 3) ** 2 + 0.5 * abs(draft_len - 4)


def _monotone(cutoff: int, draft_len: int) -> float:
    """Small experts (DeepSeek): TPOT falls all the way to the last layer; best draft 6."""
    return 30.0 - cutoff + abs(draft_len - 6)


def test_candidates_span_the_analytic_choice_and_both_ends() -> None:
    points = candidate_points(_prediction(cutoff_layer=2, draft_len=4), MOE_LAYERS)
    assert sorted({cutoff for cutoff, _ in points}) == [-1, 0, 1, 2, 3, 4, 9]
    assert sorted({length for _, length in points}) == [2, 4, 6]  # the prediction and its neighbours
    assert len(points) == 7 * 3
    assert points == sorted(points, key=lambda point: (point[1], point[0]))


def test_candidates_stay_in_range_and_take_given_draft_lengths() -> None:
    points = candidate_points(_prediction(cutoff_layer=-1, draft_len=2), MOE_LAYERS, draft_lens=[5, 3, 5])
    assert points == [(c, d) for d in (3, 5) for c in (-1, 0, 1, 9)]
    at_end = candidate_points(_prediction(cutoff_layer=9, draft_len=8), MOE_LAYERS, cutoff_span=1)
    assert sorted({c for c, _ in at_end}) == [-1, 8, 9]
    assert sorted({d for _, d in at_end}) == [4, 6, 8]  # 8 is the longest considered: shifted inward


def test_candidates_for_plain_decoding_and_unknown_draft_lengths() -> None:
    # no drafter: the prediction's curve is the single plain point
    assert candidate_points(_prediction(-1, 0, curve_lens=(0,)), MOE_LAYERS) == [(-1, 0)]
    # plain predicted faster, a drafter measured: plain and the two shortest drafts are measured
    plain_wins = candidate_points(_prediction(cutoff_layer=-1, draft_len=0), MOE_LAYERS)
    assert plain_wins == [(-1, 0)] + [(c, d) for d in (2, 4) for c in (-1, 0, 1, 9)]
    unknown = candidate_points(_prediction(2, 5, curve_lens=()), MOE_LAYERS)
    assert sorted({d for _, d in unknown}) == [3, 5, 7]


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


def test_progress_after_every_point() -> None:
    calls: list[tuple[int, int, CurvePoint]] = []
    points = [(-1, 2), (0, 2), (1, 2)]
    measured = search(points, _u_shaped, progress=lambda *call: calls.append(call))
    assert calls == [(1, 3, measured[0]), (2, 3, measured[1]), (3, 3, measured[2])]
    # cutoff 0, draft 2: 10 + (0 − 3)² + 0.5·2 = 20
    assert measured[1] == CurvePoint(0, 2, 20.0)


def test_cancel_stops_between_points() -> None:
    cancel = threading.Event()
    measured_points: list[tuple[int, int]] = []

    def measure(cutoff: int, draft_len: int) -> float:
        measured_points.append((cutoff, draft_len))
        return 1.0

    def progress(done: int, total: int, point: CurvePoint) -> None:
        if done == 2:
            cancel.set()

    with pytest.raises(GenerationCancelled, match="2 of 4"):
        search([(-1, 2), (0, 2), (1, 2), (2, 2)], measure, progress, cancel)
    assert measured_points == [(-1, 2), (0, 2)]


def test_cancel_before_the_first_point_measures_nothing() -> None:
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GenerationCancelled):
        search([(-1, 2)], lambda cutoff, draft_len: pytest.fail("measured after cancel"), cancel=cancel)


def test_a_bad_measurement_is_an_error() -> None:
    with pytest.raises(ValueError, match="positive finite"):
        search([(0, 2)], lambda cutoff, draft_len: float("nan"))


def test_choose_breaks_ties_by_smaller_cutoff_then_shorter_draft() -> None:
    tied = [CurvePoint(3, 4, 5.0), CurvePoint(1, 6, 5.0), CurvePoint(1, 2, 5.0), CurvePoint(0, 2, 6.0)]
    assert choose(tied) == CurvePoint(1, 2, 5.0)
    with pytest.raises(ValueError):
        choose([])
