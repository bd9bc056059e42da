"""The short measured search around the analytic choice: which points, measure them, pick one.

Contract: pure control flow. A point is a `Setting` (cutoff, draft length, drafter, and the prefetch
policy, cache policy and CPU execution of misses where they are not the default); the caller's
`measure(setting)` runs the calibration prompts and returns the TPOT of each run in ms. This
module chooses the points — plain decoding, then for each drafter its predicted best and the
neighbours of it (`candidate_points`), then the leader's other policies (`policy_points`) — measures
each once in order, then measures the best again with the points whose spreads overlap its own
(noise could swap them), reports progress after each, stops between measurements when cancelled
(`GenerationCancelled`), picks the fastest median, says how sure that is and why it won.
Cutoff −1 means no prefetch; draft length 0 means plain decoding (the cutoff is then
irrelevant and always −1, the drafter "").
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from engine.errors import GenerationCancelled
from engine.tune.types import CurvePoint, Prediction

log = logging.getLogger(__name__)


class Setting(NamedTuple):
    """One configuration the search measures (the fields `CurvePoint` records)."""

    cutoff_layer: int
    draft_len: int
    drafter: str = ""
    prefetch: str = ""  # "" SP-MoE to the cutoff (none at −1); "next-layer"
    policy: str = ""  # the cache policy; "" the loaded one
    cpu_experts: str = ""  # "auto": misses computed on the CPU where sooner; "" never


PLAIN = Setting(-1, 0)
POLICIES = ("lru", "lfu", "mrs")


def candidate_points(
    prediction: Prediction,
    moe_layers: int,
    cutoff_span: int = 1,
    drafters: Sequence[str] = ("draft",),
) -> list[Setting]:
    """Plain decoding, then for each drafter the points around its own predicted best.

    A drafter's best (cutoff c, draft length γ) is the fastest of its points on the prediction's
    curve, whatever plain decoding is predicted to do (a speculative point is always measured):
    at γ the cutoffs c ± `cutoff_span` within −1..moe_layers−1 and both ends (−1, no prefetch,
    and the last layer), so a monotone curve's end is always measured; at c the lengths next to
    γ among those the curve considered for it. A drafter with no point on the curve (it could
    not be profiled) is not measured.
    """
    if moe_layers < 1 or cutoff_span < 0:
        raise ValueError(f"need moe_layers >= 1 and cutoff_span >= 0, got {moe_layers}, {cutoff_span}")
    last = moe_layers - 1
    points = [PLAIN]
    for drafter in drafters:
        curve = [p for p in prediction.curve if p.draft_len > 0 and p.drafter in (drafter, "")]
        if not curve:
            continue
        best = min(curve, key=lambda p: (p.tpot_ms, p.draft_len, p.cutoff_layer))
        near = range(best.cutoff_layer - cutoff_span, best.cutoff_layer + cutoff_span + 1)
        cutoffs = sorted({-1, last, *(cutoff for cutoff in near if -1 <= cutoff <= last)})
        points += [Setting(cutoff, best.draft_len, drafter) for cutoff in cutoffs]
        lens = sorted({p.draft_len for p in curve})
        at = lens.index(best.draft_len)
        points += [
            Setting(best.cutoff_layer, n, drafter)
            for n in lens[max(0, at - 1) : at + 2]
            if n != best.draft_len
        ]
    return points


def policy_points(leader: Setting, on_gpu: bool, loaded_policy: str) -> list[Setting]:
    """The leader with each other policy that decides speed: next-layer prefetch in place of
    SP-MoE's, each other cache policy, and (on a GPU) misses computed on the CPU where sooner."""
    points = []
    if leader.prefetch != "next-layer":
        points.append(leader._replace(cutoff_layer=-1, prefetch="next-layer"))
    points += [leader._replace(policy=policy) for policy in POLICIES if policy != loaded_policy]
    if on_gpu:
        points.append(leader._replace(cpu_experts="auto"))
    return points


RIVALS = 2  # per round, the best is measured again with at most this many points its spread overlaps
Measure = Callable[[Setting], Sequence[float]]  # a setting -> the TPOTs of its runs


def setting_of(point: CurvePoint) -> Setting:
    return Setting(
        point.cutoff_layer, point.draft_len, point.drafter, point.prefetch, point.policy, point.cpu_experts
    )


def summarize(setting: Setting, runs: Sequence[float]) -> CurvePoint:
    """A point from its runs: the median, and as its spread the middle half of the runs
    (quartiles; the fastest and slowest run while there are fewer than four), so more runs
    narrow it and one outlier does not hold it open."""
    bad = [t for t in runs if not (math.isfinite(t) and t > 0)]
    if not runs or bad:
        raise ValueError(
            f"measured TPOT must be a positive finite number of ms, got {list(runs)} for {setting}"
        )
    low, high = (min(runs), max(runs)) if len(runs) < 4 else _quartiles(runs)
    s = Setting(*setting)
    return CurvePoint(
        s.cutoff_layer,
        s.draft_len,
        statistics.median(runs),
        s.drafter,
        low,
        high,
        len(runs),
        s.prefetch,
        s.policy,
        s.cpu_experts,
    )


def _quartiles(runs: Sequence[float]) -> tuple[float, float]:
    q1, _, q3 = statistics.quantiles(runs, n=4, method="inclusive")
    return q1, q3


def search(
    points: Iterable[Setting],
    measure: Measure,
    progress: Callable[[int, int, CurvePoint], None] | None = None,
    cancel: threading.Event | None = None,
    max_rounds: int = 2,
    then: Callable[[Setting], Iterable[Setting]] | None = None,
) -> tuple[CurvePoint, ...]:
    """Measure every setting in order; then the settings `then(best so far)` names (the leader's
    other policies); then the best again with the points whose spreads overlap its own (at most
    `RIVALS`, `max_rounds` more times) until it stands out; `progress(done, total, point)` after
    each (the total grows once `then`'s points are known).

    Raises `GenerationCancelled` before the next measurement once `cancel` is set, and `ValueError`
    when `measure` returns something that is not positive finite times.
    """
    queue = [Setting(*point) for point in points]
    runs: dict[Setting, list[float]] = {}
    done = 0

    def run(key: Setting, total: int) -> None:
        nonlocal done
        _check_cancel(cancel, done, max(planned, done))
        runs.setdefault(key, []).extend(measure(key))
        done += 1
        point = summarize(key, runs[key])
        log.info(
            "tune: %s: %.2f ms/token (%.2f-%.2f)", key, point.tpot_ms, point.tpot_low_ms, point.tpot_high_ms
        )
        if progress is not None:
            progress(done, total, point)

    planned = len(queue)  # the measurements named so far (a cancel says how many of them ran)
    total = len(queue) + (RIVALS + 1) * max_rounds  # at most: the rounds stop once the best stands out
    for key in queue:
        run(key, total)
    if then is not None:
        extra = [key for key in dict.fromkeys(then(setting_of(_best(runs)))) if key not in runs]
        total, planned = total + len(extra), planned + len(extra)
        for key in extra:
            run(key, total)
    for _ in range(max_rounds):
        ranked = sorted((summarize(key, times) for key, times in runs.items()), key=_rank)
        rivals = [point for point in ranked[1:] if overlap(ranked[0], point)][:RIVALS]
        if not rivals:
            break
        for point in [ranked[0], *rivals]:  # a close call: again, so the medians settle
            run(setting_of(point), total)
    return tuple(summarize(key, times) for key, times in runs.items())


def _best(runs: dict[Setting, list[float]]) -> CurvePoint:
    return choose(summarize(key, times) for key, times in runs.items())


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


DRAFTERS = {"draft": "the draft model", "self": "self-speculation", "substitute": "substitutes", "mtp": "MTP"}


def describe(point: CurvePoint) -> str:
    """A point in words: drafter, draft length, prefetch, and the policies where not the default."""
    if point.prefetch == "next-layer":
        prefetch = "next-layer prefetch"
    else:
        prefetch = "no prefetch" if point.cutoff_layer < 0 else f"prefetch to layer {point.cutoff_layer}"
    if point.draft_len == 0:
        words = ["plain decoding"] + ([prefetch] if point.prefetch else [])
    else:
        words = [DRAFTERS.get(point.drafter, "speculation"), f"draft length {point.draft_len}", prefetch]
    words += [f"{point.policy.upper()} cache"] if point.policy else []
    words += ["misses on the CPU"] if point.cpu_experts else []
    return ", ".join(words)


def explain(measured: Iterable[CurvePoint]) -> str:
    """Why the fastest won, in one sentence: against plain decoding and the best other drafter."""
    points = list(measured)
    best = choose(points)
    plain = [p for p in points if setting_of(p) == PLAIN]
    others = [p for p in points if p.draft_len and p.drafter != best.drafter]
    rival = (
        f"; the fastest other drafter, {describe(choose(others))}, took {choose(others).tpot_ms:.1f}"
        if others
        else ""
    )
    if best.draft_len == 0:
        speculative = [p for p in points if p.draft_len]
        if not speculative:
            return f"{_sentence(describe(best))} won: nothing else was measured."
        fastest = choose(speculative)
        return (
            f"{_sentence(describe(best))} won at {best.tpot_ms:.1f} ms/token: drafting and verifying cost "
            f"more than the accepted tokens saved ({describe(fastest)} took {fastest.tpot_ms:.1f})."
        )
    against = f"{plain[0].tpot_ms / best.tpot_ms:.2f}× plain decoding's speed" if plain else "the fastest"
    return f"{_sentence(describe(best))} won at {best.tpot_ms:.1f} ms/token, {against}{rival}."


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


def predicted(prediction: Prediction, point: CurvePoint) -> float | None:
    """The analytic TPOT of a measured point (its drafter's curve at its cutoff and draft length);
    None for a point the analytic model does not cover (another prefetch or cache policy)."""
    if point.prefetch or point.policy or point.cpu_experts:
        return None
    for guess in prediction.curve:
        same = (guess.cutoff_layer, guess.draft_len) == (point.cutoff_layer, point.draft_len)
        if same and guess.drafter in (point.drafter, "") and (point.draft_len > 0 or guess.draft_len == 0):
            return guess.tpot_ms
    return None


def _sentence(words: str) -> str:
    return words[:1].upper() + words[1:]
