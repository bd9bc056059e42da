"""`python -m engine.bench --compare`: every decoding configuration side by side, one table.

Each configuration (speculation mode × prefetch policy × cache policy) loads the
model with the same expert budget and link, warms up, then generates the same
greedy, fixed-length replies; the row with the median `tpot_ms` of `--repeats`
passes is reported, with the hit rates, acceptance, prefetch precision/recall and
bytes copied per token. Every row also says whether its tokens equal the
on-demand LRU baseline's (they must: greedy speculation is lossless).

`--sim-link calibrated` (no GPU) first times one decoder layer with every expert
resident, then simulates a link on which one expert's copy takes `LINK_RATIO` ×
that time, about the ratio of Qwen3-30B-A3B in bf16 on an RTX 4090 over PCIe 4.0 x16, where
an expert's copy takes longer than a layer's compute. Hybrid CPU execution
is left out of simulated comparisons: there the "device" is the CPU, so computing
on the CPU would be free. Everything measured over a simulated link says so.
"""

from __future__ import annotations

import argparse
import logging
import statistics
from dataclasses import dataclass, replace

from engine.config import ExpertBudget, OffloadConfig
from engine.device_cache.stats import PHASES

log = logging.getLogger(__name__)

LINK_RATIO = 3.0  # one expert's copy time / one layer's decode time (Qwen3-30B-A3B, RTX 4090, PCIe 4)


@dataclass(frozen=True)
class Configuration:
    name: str
    spec: str = "none"
    prefetch: str = "none"
    policy: str = "lru"
    cached_only: bool = False


CONFIGURATIONS = (
    Configuration("on-demand LRU"),
    Configuration("next-layer", prefetch="next-layer"),
    Configuration("hybrimoe", prefetch="hybrimoe", policy="mrs"),
    Configuration("draft", spec="draft"),
    Configuration("draft+spmoe", spec="draft", prefetch="spmoe"),
    Configuration("self", spec="self"),
    Configuration("self+spmoe", spec="self", prefetch="spmoe"),
    Configuration("self-cached+spmoe", spec="self", prefetch="spmoe", cached_only=True),
    Configuration("substitute", spec="substitute"),
    Configuration("substitute+spmoe", spec="substitute", prefetch="spmoe"),
    Configuration("mtp", spec="mtp"),  # only where the checkpoint has an MTP layer
    Configuration("mtp+spmoe", spec="mtp", prefetch="spmoe"),
)


@dataclass(frozen=True)
class CompareRow:
    name: str
    spec: str
    prefetch: str
    policy: str
    tpot_ms: float
    tokens_per_s: float
    hit_rate: float | None
    hit_rate_verify: float | None
    accept_len: float | None
    draft_len: float | None
    h2d_bytes_per_token: float | None
    prefetch_precision: float | None
    prefetch_recall: float | None
    lossless: bool
    same_tokens_as_baseline: bool | None
    drafter_device_bytes: int
    decode_tokens: int
    simulated_link: bool
    copy_hidden: float | None = None  # share of the link's copy time compute did not wait for


def calibrate_link(folder: str, base: OffloadConfig, prompt_ids, new_tokens: int) -> tuple[float, float]:
    """(GB/s, layer ms): a simulated link on which one expert's copy takes LINK_RATIO × one layer's decode."""
    from engine.generation import generate_text
    from engine.loader import load_model
    from engine.prompts import greedy

    resident = replace(base, expert_budget=ExpertBudget.parse("all"), sim_link_gbps=None, sim_latency_us=0.0)
    model = load_model(folder, resident)
    try:
        generate_text(model, prompt_ids[0], greedy(8))  # warm-up: every expert becomes resident
        tpots = [generate_text(model, ids, greedy(new_tokens)).stats.tpot_ms for ids in prompt_ids]
        layer_ms = statistics.median(tpots) / model.hf_config.num_hidden_layers
        gbps = model.store.expert_nbytes / (LINK_RATIO * layer_ms / 1e3) / 1e9
    finally:
        model.close()
    return gbps, layer_ms


def _generation_config(conf: Configuration, args, new_tokens: int):
    from engine.options import spec_config
    from engine.prompts import greedy

    spec_args = argparse.Namespace(**{**vars(args), "spec": conf.spec, "cached_only": conf.cached_only})
    return replace(
        greedy(new_tokens), spec=spec_config(spec_args), prefetch=conf.prefetch, cutoff=args.cutoff
    )


def bench_configuration(conf: Configuration, folder: str, offload: OffloadConfig, args, prompt_ids):
    """Median-tpot pass of one configuration, and the token ids it produced."""
    from engine.device_cache.transfer import metered
    from engine.generation import generate_text
    from engine.loader import load_model

    model = load_model(folder, replace(offload, policy=conf.policy))
    try:
        gen = _generation_config(conf, args, args.new_tokens)
        generate_text(model, prompt_ids[0][:8], replace(gen, max_new_tokens=8))  # warm-up (loads drafters)
        passes = []
        for _ in range(args.repeats):
            with metered(model.transfer) as meter:
                runs = [generate_text(model, ids, gen) for ids in prompt_ids]
            passes.append((runs, meter.hidden))
        drafter_bytes = model.drafter_nbytes()
    finally:
        model.close()
    median, hidden = sorted(passes, key=lambda p: _pass_tpot(p[0]))[len(passes) // 2]
    return replace(_row(conf, median, drafter_bytes), copy_hidden=hidden), [r.token_ids for r in median]


def _pass_tpot(runs) -> float:
    return sum(r.stats.decode_ms for r in runs) / sum(r.stats.generated_tokens - 1 for r in runs)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def _row(conf: Configuration, runs, drafter_bytes: int) -> CompareRow:
    stats = [r.stats for r in runs]
    decode_tokens = sum(s.generated_tokens - 1 for s in stats)
    uses = {
        p: sum(getattr(s, p).hits + getattr(s, p).misses for s in stats)
        for p in ("decode", "draft", "verify")
    }
    hits = {p: sum(getattr(s, p).hits for s in stats) for p in ("decode", "draft", "verify")}
    steps = sum(s.verify_steps for s in stats)
    recall_phase = "verify" if conf.spec != "none" else "decode"
    all_phases = [getattr(s, p) for s in stats for p in PHASES]
    prefetched = sum(phase.prefetched for phase in all_phases)
    used = sum(phase.prefetch_used for phase in all_phases)
    tpot = _pass_tpot(runs)
    return CompareRow(
        name=conf.name,
        spec=conf.spec,
        prefetch=stats[0].prefetch,
        policy=conf.policy,
        tpot_ms=tpot,
        tokens_per_s=1e3 / tpot,
        hit_rate=_ratio(sum(hits.values()), sum(uses.values())),
        hit_rate_verify=_ratio(hits["verify"], uses["verify"]),
        accept_len=_ratio(sum((s.accept_len or 0) * s.verify_steps for s in stats), steps),
        draft_len=_ratio(sum((s.draft_len or 0) * s.verify_steps for s in stats), steps),
        h2d_bytes_per_token=_ratio(
            sum((s.bytes_per_token or 0) * (s.generated_tokens - 1) for s in stats), decode_tokens
        ),
        prefetch_precision=_ratio(used, prefetched),
        prefetch_recall=_ratio(
            sum(getattr(s, recall_phase).prefetch_hits for s in stats), uses[recall_phase]
        ),
        lossless=all(s.lossless for s in stats),
        same_tokens_as_baseline=None,
        drafter_device_bytes=drafter_bytes,
        decode_tokens=decode_tokens,
        simulated_link=stats[0].simulated_link,
    )


def run_compare(args) -> dict:
    """Every configuration on one model, budget and link, as one JSON result."""
    from engine.loader import load_model
    from engine.options import model_folder, offload_config
    from engine.prompts import PROMPTS, encode_prompts
    from engine.speculative.mtp import has_mtp_layer

    folder = model_folder(args)
    offload = offload_config(args)
    probe = load_model(folder, replace(offload, expert_budget=ExpertBudget.parse("all"), sim_link_gbps=None))
    try:
        prompt_ids = encode_prompts(probe, PROMPTS[: args.prompts])
        total_experts = probe.store.total_experts
        has_mtp = has_mtp_layer(probe)
    finally:
        probe.close()
    if offload.expert_budget.is_auto:  # the comparison's default: a quarter of the experts cached
        offload = replace(offload, expert_budget=ExpertBudget.parse(max(total_experts // 4, 1)))
    calibration = None
    if args.sim_link == "calibrated":
        gbps, layer_ms = calibrate_link(folder, offload, prompt_ids, args.new_tokens)
        offload = replace(offload, sim_link_gbps=gbps, sim_latency_us=0.0)
        calibration = {"layer_ms": layer_ms, "link_gbps": gbps, "copy_over_layer": LINK_RATIO}
    rows, baseline = [], None
    for conf in _selected(args, has_mtp):
        log.info("bench --compare: %s", conf.name)
        row, tokens = bench_configuration(conf, folder, offload, args, prompt_ids)
        baseline = baseline if baseline is not None else tokens
        rows.append(replace(row, same_tokens_as_baseline=tokens == baseline))
    return {
        "simulated_link": rows[0].simulated_link,
        "model": folder,
        "expert_budget": str(offload.expert_budget),
        "total_experts": total_experts,
        "calibration": calibration,
        "rows": [vars(r) for r in rows],
    }


def _selected(args, has_mtp: bool) -> list[Configuration]:
    """The asked configurations (all by default, the MTP ones only where the checkpoint has an MTP
    layer); the baseline always first."""
    if not args.configs:
        if not has_mtp:
            log.info("bench --compare: no MTP layer in this checkpoint, mtp rows left out")
        return [c for c in CONFIGURATIONS if has_mtp or c.spec != "mtp"]
    names = {c.name: c for c in CONFIGURATIONS}
    unknown = [n for n in args.configs if n not in names]
    if unknown:
        from engine.errors import InvalidRequestError

        raise InvalidRequestError(f"Unknown configuration {unknown[0]!r}; choose from {', '.join(names)}.")
    return [CONFIGURATIONS[0]] + [names[n] for n in args.configs if n != CONFIGURATIONS[0].name]


def format_compare(result: dict) -> str:
    def num(value, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    head = f"{'configuration':<20}{'tpot_ms':>9}{'tok/s':>8}{'speedup':>8}{'hit':>6}{'hit_v':>6}"
    head += f"{'acc_len':>8}{'γ':>5}{'KB/tok':>8}{'hidden':>7}{'pf_prec':>8}{'pf_rec':>7}  same"
    lines = [head]
    base = result["rows"][0]["tpot_ms"]
    for r in result["rows"]:
        lines.append(
            f"{r['name']:<20}{r['tpot_ms']:>9.2f}{r['tokens_per_s']:>8.1f}{base / r['tpot_ms']:>7.2f}×"
            f"{num(r['hit_rate'], '.0%'):>6}{num(r['hit_rate_verify'], '.0%'):>6}"
            f"{num(r['accept_len'], '.2f'):>8}{num(r['draft_len'], '.1f'):>5}"
            f"{num(r['h2d_bytes_per_token'] and r['h2d_bytes_per_token'] / 1e3, '.0f'):>8}"
            f"{num(r.get('copy_hidden'), '.0%'):>7}"
            f"{num(r['prefetch_precision'], '.0%'):>8}{num(r['prefetch_recall'], '.0%'):>7}"
            f"  {'yes' if r['same_tokens_as_baseline'] else 'NO'}"
        )
    cal = result.get("calibration")
    if cal:
        lines.append(
            f"calibrated link: one layer {cal['layer_ms']:.3f} ms, expert copy = "
            f"{cal['copy_over_layer']:.0f}× that = {cal['link_gbps']:.3f} GB/s"
        )
    lines.append(f"budget {result['expert_budget']} of {result['total_experts']} experts")
    if result["simulated_link"]:
        lines.append("SIMULATED link (no GPU): these timings are simulated, not a real PCIe measurement.")
    return "\n".join(lines)
