"""One auto-tune run: probe → profile → predict → measured search → choice, remembered.

`tune(model, config)` works on a loaded `OffloadedModel`: a stored result for the
same (GPU, model, budget, precision) is returned as it is (`reused=True`) unless
`config.retune`; otherwise it probes the machine, profiles the model and every drafter that
applies (`drafters_for`: its draft model, found as `generate` finds it; its MTP layer; self-
speculation; substitutes), applies the papers' models per drafter (`engine.tune.analytic`) and
measures TPOT on a short calibration set at plain decoding and, per drafter, the cutoffs and draft
lengths around its predicted best (`engine.tune.search`), then the leader under the other prefetch
and cache policies (and CPU execution of misses on a GPU), twice per point and again where the
best is within the noise of others; keeps the fastest median, says how sure that is and why it
won, and stores it. Progress is reported as (stage, done, total); `cancel` stops between
measurements.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil

from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.speculative.auto import bundled_draft
from engine.speculative.mtp import has_mtp_layer
from engine.text.prompt_ids import encode_prompt
from engine.tune.analytic import predict
from engine.tune.probe import probe
from engine.tune.profile import profile_model
from engine.tune.search import Setting, candidate_points, certainty, choose, explain, policy_points, search
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
    fingerprint = model_fingerprint(str(model.path))
    key = tune_key(hardware.gpu_uuid, str(model.path), fingerprint, str(budget), model.info().expert_dtype)
    stored = None if config.retune else store.get(key)
    if stored is not None:
        log.info("Auto-tune: reusing the stored result for %s", key)
        return stored

    draft_model = config.draft_model or bundled_draft(model)  # as `generate` finds it
    drafters = drafters_for(model, draft_model)  # as loaded: profiling holds every expert on a CPU
    report("profile", 0, 1)
    with _resident_experts_on_cpu(model):
        profile = profile_model(model, draft_model, config.context_tokens, progress, cancel, drafters)
    prediction = predict(profile, hardware, budget + profile.peak_non_expert_bytes)
    points = candidate_points(prediction, profile.moe_layers, drafters=[d.name for d in profile.drafters])
    prompts = [encode_prompt(model, text) for text in CALIBRATION_PROMPTS]
    loaded_policy = model.config.policy

    def measure(setting: Setting) -> list[float]:
        with _cache_policy(model, setting.policy or loaded_policy):
            return _measure_tpot(model, prompts, config, setting, draft_model)

    def on_point(done: int, total: int, point) -> None:
        report("search", done, total)

    def others(leader: Setting) -> list[Setting]:
        return policy_points(leader, model.device.type == "cuda", loaded_policy)

    measured = search(points, measure, on_point, cancel, then=others)
    result = TuneResult(hardware, profile, prediction, measured, _choice(measured, model), key, reused=False)
    store.put(result)
    return result


def _choice(measured, model) -> TuneChoice:
    """The fastest measured point as the choice, with how sure it is and why it won."""
    best = choose(measured)
    return TuneChoice(
        cutoff_layer=best.cutoff_layer,
        draft_len=best.draft_len,
        cache_experts=model.cache.n_slots,
        expected_tokens_per_s=1e3 / best.tpot_ms,
        drafter=best.drafter,
        certainty=certainty(measured),
        prefetch=best.prefetch,
        policy=best.policy,
        cpu_experts=best.cpu_experts,
        why=explain(measured),
    )


def drafters_for(model, draft_model: str | None) -> tuple[str, ...]:
    """The drafters that apply: the model's draft model when it has one, its own MTP layer where
    the checkpoint carries one, and where the router picks two or more experts a token, the
    target drafting with fewer (SS-MoE `self`) and, where experts are copied over a link, with
    low-bit substitutes of its experts held on the device (SubSpec)."""
    drafters = ["draft"] if draft_model else []
    if hasattr(model, "draft_models") and has_mtp_layer(model):
        drafters.append("mtp")
    if model.top_k >= 2:
        drafters.append("self")
        if not (model.cache.in_place or model.cache.holds_all):
            drafters.append("substitute")
    return tuple(drafters)


@contextlib.contextmanager
def _cache_policy(model, policy: str):
    """The expert cache under `policy` while a point is measured (emptied on each change, as a
    fresh load would start), back to the loaded one afterwards."""
    model.use_cache_policy(policy)
    try:
        yield
    finally:
        model.use_cache_policy(model.config.policy)


def _measure_tpot(
    model, prompts, config: TuneConfig, setting: Setting, draft_model: str | None
) -> list[float]:
    """One TPOT per pass over the calibration prompts (decode time / tokens, all prompts),
    speculative with a fixed draft length."""
    base = GenerationConfig(
        max_new_tokens=config.new_tokens, sampling=SamplingConfig(greedy=True), ignore_eos=True
    )
    gen = choice_config(base, setting, draft_model, adapt_draft_len=False)
    generate_text(model, prompts[0], replace(gen, max_new_tokens=4))  # warm-up: drafter, caches
    runs = []
    for _ in range(config.passes):
        stats = [generate_text(model, ids, gen).stats for ids in prompts]
        tokens = sum(s.generated_tokens for s in stats if s.tpot_ms is not None)
        runs.append(sum(s.tpot_ms * s.generated_tokens for s in stats if s.tpot_ms is not None) / tokens)
    return runs


def choice_config(
    base: GenerationConfig, point, draft_model: str | None, adapt_draft_len: bool = True
) -> GenerationConfig:
    """`base` with what a tune point (a `Setting`, `CurvePoint` or `TuneChoice`) runs with: its
    drafter (`draft_model` for "draft"; a choice that recorded none drafts with `draft_model`,
    else the target itself), draft length (0: plain decoding), prefetch (SP-MoE to the cutoff,
    none at −1, or next-layer) and CPU execution of misses. With `adapt_draft_len` (as the app
    applies a choice) the draft length is where the online controller starts; without it, it is
    held there (as the search measures). The cache policy is the model's, set apart."""
    if point.prefetch == "next-layer":
        prefetch, cutoff = "next-layer", None
    else:
        spmoe = point.cutoff_layer >= 0 and point.draft_len > 0
        prefetch, cutoff = ("spmoe", point.cutoff_layer) if spmoe else ("none", None)
    base = replace(base, prefetch=prefetch, cutoff=cutoff, cpu_experts=point.cpu_experts or base.cpu_experts)
    if point.draft_len == 0:
        return base
    mode = point.drafter or ("draft" if draft_model else "self")
    spec = SpecConfig(
        mode=mode,
        draft_model=draft_model if mode == "draft" else None,
        draft_len=point.draft_len,
        adapt_draft_len=adapt_draft_len,
    )
    return replace(base, spec=spec)


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
