"""One auto-tune run: probe → profile → predict → measured search → choice, remembered.

`tune(model, config)` works on a loaded `OffloadedModel`: a stored result for the
same (GPU, model, budget, precision) is returned as it is (`reused=True`) unless
`config.retune`; otherwise it probes the machine, profiles the model, applies the
papers' models (`engine.tune.analytic`) and measures TPOT on a short calibration
set at the cutoffs and draft lengths around the analytic choice
(`engine.tune.search`) for each drafter that applies (the model's draft model, and
self-speculation), twice per point and again where the best is within the noise of others,
keeps the fastest median, says how sure that is, and stores it. Progress is reported as
(stage, done, total); `cancel` stops between measurements.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil

from engine.generation import encode_prompt, generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.tune.analytic import predict
from engine.tune.probe import probe
from engine.tune.profile import profile_model
from engine.tune.search import candidate_points, certainty, choose, search
from engine.tune.store import TuneStore, model_fingerprint, tune_key
from engine.tune.types import TuneChoice, TuneResult

log = logging.getLogger(__name__)

CALIBRATION_PROMPTS = (
    "What sound does a cow make?",
    "Tell me a short story about a red fox.",
    "What is the capital of France?",
)

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class TuneConfig:
    """What to tune for: the drafter, the calibration length, and whether to ignore a stored result."""

    draft_model: str | None = None  # None: self-speculation (SS-MoE), no separate drafter
    new_tokens: int = 32  # generated per calibration prompt and point
    passes: int = 2  # runs over the calibration prompts per point (more where the best overlaps others)
    context_tokens: int = 4096  # the context the memory plan must hold
    retune: bool = False
    sim_link_gbps: float | None = None  # the probe's link without a GPU (the model's own, when simulated)


def tune(
    model,
    config: TuneConfig = TuneConfig(),
    progress: Progress | None = None,
    cancel: threading.Event | None = None,
    store: TuneStore | None = None,
) -> TuneResult:
    store = store or TuneStore()
    report = progress or (lambda stage, done, total: None)
    model_gbps, model_latency_us = _model_link(model)
    hardware = probe(
        str(model.device),
        sim_link_gbps=config.sim_link_gbps or model_gbps,
        sim_latency_us=model_latency_us if model_gbps else 10.0,  # the model's own link, as simulated
        expert_nbytes=model.store.expert_nbytes,  # fit the link on this model's own expert size
    )
    budget = model.cache.n_slots * model.store.expert_nbytes
    key = tune_key(
        hardware.gpu_uuid,
        str(model.path),
        model_fingerprint(str(model.path)),
        str(budget),
        model.info().expert_dtype,
    )
    stored = None if config.retune else store.get(key)
    if stored is not None:
        log.info("Auto-tune: reusing the stored result for %s", key)
        return stored

    report("profile", 0, 1)
    with _resident_experts_on_cpu(model):
        profile = profile_model(model, config.draft_model, config.context_tokens, progress, cancel)
    prediction = predict(profile, hardware, budget + profile.peak_non_expert_bytes)
    points = candidate_points(
        prediction, profile.moe_layers, drafters=drafters_for(model, config.draft_model)
    )
    prompts = [encode_prompt(model, text) for text in CALIBRATION_PROMPTS]

    def measure(cutoff: int, draft_len: int, drafter: str) -> list[float]:
        return _measure_tpot(model, prompts, config, cutoff, draft_len, drafter)

    def on_point(done: int, total: int, point) -> None:
        report("search", done, total)

    measured = search(points, measure, on_point, cancel)
    best = choose(measured)
    choice = TuneChoice(
        best.cutoff_layer,
        best.draft_len,
        model.cache.n_slots,
        1e3 / best.tpot_ms,
        best.drafter,
        certainty(measured),
    )
    result = TuneResult(hardware, profile, prediction, measured, choice, key, reused=False)
    store.put(result)
    return result


def drafters_for(model, draft_model: str | None) -> tuple[str, ...]:
    """The drafters that apply: the model's draft model when it has one, and self-speculation
    (SS-MoE: the target with fewer experts per token) where the router picks two or more."""
    return (("draft",) if draft_model else ()) + (("self",) if model.top_k >= 2 else ())


def _measure_tpot(
    model, prompts, config: TuneConfig, cutoff: int, draft_len: int, drafter: str
) -> list[float]:
    """One TPOT per pass over the calibration prompts (decode time / tokens, all prompts),
    speculative with a fixed draft length."""
    base = GenerationConfig(
        max_new_tokens=config.new_tokens, sampling=SamplingConfig(greedy=True), ignore_eos=True
    )
    draft_model = config.draft_model if drafter == "draft" else None
    gen = choice_config(base, cutoff, draft_len, draft_model, adapt_draft_len=False)
    generate_text(model, prompts[0], replace(gen, max_new_tokens=4))  # warm-up: drafter, caches
    runs = []
    for _ in range(config.passes):
        stats = [generate_text(model, ids, gen).stats for ids in prompts]
        tokens = sum(s.generated_tokens for s in stats if s.tpot_ms is not None)
        runs.append(sum(s.tpot_ms * s.generated_tokens for s in stats if s.tpot_ms is not None) / tokens)
    return runs


def choice_config(
    base: GenerationConfig,
    cutoff_layer: int,
    draft_len: int,
    draft_model: str | None,
    adapt_draft_len: bool = True,
) -> GenerationConfig:
    """`base` with the speculation and prefetch of a tune point: draft length 0 is plain decoding,
    cutoff −1 no prefetch; the drafter is `draft_model`, or the target itself (SS-MoE) without one.
    With `adapt_draft_len` (as the app applies a choice) the draft length is where the online
    controller starts; without it, it is held there (as the search measures)."""
    if draft_len == 0:
        return base
    spec = SpecConfig(
        mode="draft" if draft_model else "self",
        draft_model=draft_model,
        draft_len=draft_len,
        adapt_draft_len=adapt_draft_len,
    )
    spmoe = cutoff_layer >= 0
    return replace(
        base, spec=spec, prefetch="spmoe" if spmoe else "none", cutoff=cutoff_layer if spmoe else None
    )


@contextlib.contextmanager
def _resident_experts_on_cpu(model):
    """On a CPU device the "device" cache is host memory: hold every expert while profiling, so
    compute is timed without copies, when that second copy of the experts fits in free RAM twice
    over (otherwise, as on a GPU, the profiler subtracts the copies it saw)."""
    slots = model.cache.n_slots
    extra_nbytes = (model.store.total_experts - slots) * model.store.expert_nbytes
    if (
        model.device.type != "cpu"
        or extra_nbytes <= 0
        or extra_nbytes * 2 > psutil.virtual_memory().available  # a large model: subtract copies instead
    ):
        yield
        return
    model.cache.resize(model.store.total_experts)
    try:
        yield
    finally:
        model.cache.resize(slots)


def _model_link(model) -> tuple[float | None, float]:
    """The model's simulated link: (GB/s, µs per copy); (None, 0) on a real link or none."""
    link = model.transfer
    if not model.simulated_link or getattr(link, "gbps", None) is None:
        return None, 0.0
    return link.gbps, getattr(link, "latency_s", 0.0) * 1e6
