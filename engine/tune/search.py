"""The short measured search around the analytic choice: which points, measure them, pick one.

Contract: pure control flow. The caller's `measure(cutoff_layer, draft_len)` runs the
calibration prompts and returns the measured TPOT in ms; this module chooses the points,
calls it once per point in order, reports progress after each, stops between points when
cancelled (`GenerationCancelled`) and picks the fastest point. Cutoff −1 means no prefetch;
draft length 0 means plain decoding (the cutoff is then irrelevant and always −1).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Iterable

from engine.errors import GenerationCancelled
from engine.tune.types import CurvePoint, Prediction

log = logging.getLogger(__name__)


def candidate_points(
    prediction: Prediction,
    moe_layers: int,
    cutoff_span: int = 2,
    draft_lens: Iterable[int] | None = None,
) -> list[tuple[int, int]]:
    """(cutoff, draft_len) pairs to measure, ordered by draft length then cutoff.

    Cutoffs: the predicted one ± `cutoff_span` within −1..moe_layers−1, plus both ends (−1, no
    prefetch, and the last layer), so a monotone curve's end is always measured. Draft
    lengths: `draft_lens` when given, else the predicted one and its neighbours among the
    lengths the prediction's curve considered (two or three; ±2 when the curve has no
    others). Draft length 0 (plain decoding) is measured once, at cutoff −1.
    """
    if moe_layers < 1 or cutoff_span < 0:
        raise ValueError(f"need moe_layers >= 1 and cutoff_span >= 0, got {moe_layers}, {cutoff_span}")
    lens = sorted(set(draft_lens)) if draft_lens is not None else _draft_lens_around(prediction)
    if any(draft_len < 0 for draft_len in lens):
        raise ValueError(f"draft lengths must be >= 0, got {lens}")
    last = moe_layers - 1
    near = range(prediction.cutoff_layer - cutoff_span, prediction.cutoff_layer + cutoff_span + 1)
    cutoffs = sorted({-1, last, *(cutoff for cutoff in near if -1 <= cutoff <= last)})
    points = []
    for draft_len in lens:
        points.extend([(-1, 0)] if draft_len == 0 else [(cutoff, draft_len) for cutoff in cutoffs])
    return points


def search(
    points: Iterable[tuple[int, int]],
    measure: Callable[[int, int], float],
    progress: Callable[[int, int, CurvePoint], None] | None = None,
    cancel: threading.Event | None = None,
) -> tuple[CurvePoint, ...]:
    """Measure every point in order; `progress(done, total, point)` after each.

    Raises `GenerationCancelled` before the next point once `cancel` is set, and `ValueError`
    when `measure` returns something that is not a positive finite time.
    """
    points = list(points)
    measured: list[CurvePoint] = []
    for cutoff_layer, draft_len in points:
        if cancel is not None and cancel.is_set():
            done = f"{len(measured)} of {len(points)}"
            raise GenerationCancelled(f"Tuning cancelled after {done} measurements.")
        tpot_ms = measure(cutoff_layer, draft_len)
        if not (math.isfinite(tpot_ms) and tpot_ms > 0):
            raise ValueError(
                f"measured TPOT must be a positive finite number of ms, got {tpot_ms} "
                f"for cutoff {cutoff_layer}, draft length {draft_len}"
            )
        point = CurvePoint(cutoff_layer, draft_len, tpot_ms)
        measured.append(point)
        log.info("tune: cutoff %d, draft length %d: %.2f ms/token", cutoff_layer, draft_len, tpot_ms)
        if progress is not None:
            progress(len(measured), len(points), point)
    return tuple(measured)


def choose(measured: Iterable[CurvePoint]) -> CurvePoint:
    """The fastest point; ties go to the smaller cutoff, then the shorter draft."""
    points = list(measured)
    if not points:
        raise ValueError("nothing was measured to choose from")
    return min(points, key=lambda point: (point.tpot_ms, point.cutoff_layer, point.draft_len))


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
