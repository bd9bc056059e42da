"""The short measured search around the analytic choice: which points, measure them, pick one.

Contract: pure control flow. The caller's `measure(cutoff_layer, draft_len, drafter)` runs
the calibration prompts and returns the TPOT of each run in ms; this module chooses the
points, measures each once in order, then measures the best again with the points whose
spreads overlap its own (noise could swap them), reports progress after each, stops between measurements
when cancelled (`GenerationCancelled`), picks the fastest median and says how sure that is.
Cutoff −1 means no prefetch; draft length 0 means plain decoding (the cutoff is then
irrelevant and always −1, the drafter "").
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence

from engine.errors import GenerationCancelled
from engine.tune.types import CurvePoint, Prediction

log = logging.getLogger(__name__)


def candidate_points(
    prediction: Prediction,
    moe_layers: int,
    cutoff_span: int = 2,
    draft_lens: Iterable[int] | None = None,
    drafters: Sequence[str] = ("draft",),
) -> list[tuple[int, int, str]]:
    """(cutoff, draft_len, drafter) to measure, by drafter, then draft length, then cutoff.

    Cutoffs: the predicted one ± `cutoff_span` within −1..moe_layers−1, plus both ends (−1, no
    prefetch, and the last layer), so a monotone curve's end is always measured. Draft
    lengths: `draft_lens` when given, else the predicted one and its neighbours among the
    lengths the prediction's curve considered (two or three; ±2 when the curve has no
    others), and plain decoding always, as the baseline speculation must beat. Each drafter
    gets every speculative point; draft length 0 (plain decoding) is measured once, at
    cutoff −1, with no drafter.
    """
    if moe_layers < 1 or cutoff_span < 0:
        raise ValueError(f"need moe_layers >= 1 and cutoff_span >= 0, got {moe_layers}, {cutoff_span}")
    lens = sorted(set(draft_lens) if draft_lens is not None else {0, *_draft_lens_around(prediction)})
    if any(draft_len < 0 for draft_len in lens):
        raise ValueError(f"draft lengths must be >= 0, got {lens}")
    last = moe_layers - 1
    near = range(prediction.cutoff_layer - cutoff_span, prediction.cutoff_layer + cutoff_span + 1)
    cutoffs = sorted({-1, last, *(cutoff for cutoff in near if -1 <= cutoff <= last)})
    points = [(-1, 0, "")] if 0 in lens else []
    for drafter in drafters:
        points += [(cutoff, draft_len, drafter) for draft_len in lens if draft_len for cutoff in cutoffs]
    return points


RIVALS = 2  # per round, the best is measured again with at most this many points its spread overlaps
Measure = Callable[[int, int, str], Sequence[float]]  # (cutoff, draft_len, drafter) -> TPOTs of runs


def summarize(cutoff_layer: int, draft_len: int, drafter: str, runs: Sequence[float]) -> CurvePoint:
    """A point from its runs: the median, and as its spread the middle half of the runs
    (quartiles; the fastest and slowest run while there are fewer than four), so more runs
    narrow it and one outlier does not hold it open."""
    bad = [t for t in runs if not (math.isfinite(t) and t > 0)]
    if not runs or bad:
        raise ValueError(
            f"measured TPOT must be a positive finite number of ms, got {list(runs)} "
            f"for cutoff {cutoff_layer}, draft length {draft_len}"
        )
    low, high = (min(runs), max(runs)) if len(runs) < 4 else _quartiles(runs)
    return CurvePoint(cutoff_layer, draft_len, statistics.median(runs), drafter, low, high, len(runs))


def _quartiles(runs: Sequence[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive")
    return q1, q3


def search(
    points: Iterable[tuple[int, int, str]],
    measure: Measure,
    progress: Callable[[int, int, CurvePoint], None] | None = None,
    cancel: threading.Event | None = None,
    max_rounds: int = 2,
) -> tuple[CurvePoint, ...]:
    """Measure every (cutoff, draft_len, drafter) in order, then measure the best again with the
    points whose spreads overlap its own (at most `RIVALS`, `max_rounds` more times) until it stands
    out; `progress(done, total, point)` after each.

    Raises `GenerationCancelled` before the next measurement once `cancel` is set, and `ValueError`
    when `measure` returns something that is not positive finite times.
    """
    points = list(points)
    runs: dict[tuple[int, int, str], list[float]] = {}
    total = len(points) + (RIVALS + 1) * max_rounds  # at most: the rounds stop once the best stands out
    for key in points:
        _check_cancel(cancel, len(runs), len(points))
        runs[key] = list(measure(*key))
        point = summarize(*key, runs[key])
        log.info(
            "tune: %s: %.2f ms/token (%.2f-%.2f)", key, point.tpot_ms, point.tpot_low_ms, point.tpot_high_ms
        )
        if progress is not None:
            progress(len(runs), total, point)
    for round_ in range(max_rounds):
        ranked = sorted((summarize(*key, times) for key, times in runs.items()), key=_rank)
        rivals = [point for point in ranked[1:] if overlap(ranked[0], point)][:RIVALS]
        if not rivals:
            break
        for rank, point in enumerate([ranked[0], *rivals]):  # a close call: again, so the medians settle
            _check_cancel(cancel, len(points), len(points))
            key = (point.cutoff_layer, point.draft_len, point.drafter)
            runs[key] += measure(*key)
            if progress is not None:
                progress(len(points) + (RIVALS + 1) * round_ + rank + 1, total, summarize(*key, runs[key]))
    return tuple(summarize(*key, times) for key, times in runs.items())


def _check_cancel(cancel: threading.Event | None, done: int, total: int) -> None:
    if cancel is not None and cancel.is_set():
        raise GenerationCancelled(f"Tuning cancelled after {done} of {total} measurements.")


def overlap(a: CurvePoint, b: CurvePoint) -> bool:
    """Whether two points' spreads overlap: noise could swap them."""
    return a.tpot_low_ms <= b.tpot_high_ms and b.tpot_low_ms <= a.tpot_high_ms


def _rank(point: CurvePoint) -> tuple:
    return (point.tpot_ms, point.cutoff_layer, point.draft_len, point.drafter)


def choose(measured: Iterable[CurvePoint]) -> CurvePoint:
    """The fastest median; ties go to the smaller cutoff, then the shorter draft."""
    points = list(measured)
    if not points:
        raise ValueError("nothing was measured to choose from")
    return min(points, key=_rank)


def describe(point: CurvePoint) -> str:
    if point.draft_len == 0:
        return "plain decoding"
    drafter = {"draft": "the draft model", "self": "self-speculation"}.get(point.drafter, "speculation")
    prefetch = "no prefetch" if point.cutoff_layer < 0 else f"prefetch to layer {point.cutoff_layer}"
    return f"{drafter}, draft length {point.draft_len}, {prefetch}"


def certainty(measured: Iterable[CurvePoint]) -> str:
    """How sure the choice is, in words: the best against the runner-up, given their spreads."""
    ranked = sorted(measured, key=_rank)
    if len(ranked) < 2:
        return "Only one configuration was measured."
    best = ranked[0]
    second = next((point for point in ranked[1:] if overlap(best, point)), ranked[1])
    gain = 100.0 * (second.tpot_ms - best.tpot_ms) / second.tpot_ms
    versus = f"{best.tpot_ms:.1f} ms/token against {second.tpot_ms:.1f} for {describe(second)}"
    if not overlap(best, second):
        return f"Sure: {gain:.0f}% faster than the runner-up, beyond the spread of the runs ({versus})."
    return (
        f"Close call: within the noise of the runner-up after {best.runs} runs ({versus}); "
        "either runs about as fast."
    )


def _draft_lens_around(prediction: Prediction) -> list[int]:
    """The predicted draft length and its neighbours among those the curve considered.

    Three lengths, shifted inward at either end of the range: predicted plain decoding (0) is
    measured beside the two shortest drafts, in case the acceptance was underestimated.
    """
    plain = {0} if prediction.draft_len == 0 else set()
    considered = sorted({point.draft_len for point in prediction.curve} | plain)
    if prediction.draft_len not in considered:
        return sorted({max(1, prediction.draft_len - 2), prediction.draft_len, prediction.draft_len + 2})
    at = considered.index(prediction.draft_len)
    start = max(0, min(at - 1, len(considered) - 3))  # three lengths, shifted inward at either end
    return considered[start : start + 3]
