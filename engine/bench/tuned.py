"""`python -m engine.bench --tuned`: tuned settings against the defaults, side by side in one run.

Loads the model once, auto-tunes it (or reuses the stored result), then times the
default configuration (no speculation, no prefetch) and the tuned one (its drafter, draft
length, cutoff and prefetch; both under its cache policy) in alternating passes over the same
prompts, and sets
the analytic prediction of the tuned TPOT beside the measurement. Every figure
carries `simulated_link`.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, replace


def run_tuned(args) -> dict:
    from engine.generation import generate_text
    from engine.loader import load_model
    from engine.options import model_folder, offload_config
    from engine.prompts import PROMPTS, encode_prompts, greedy
    from engine.speculative.auto import bundled_draft
    from engine.tune.run import TuneConfig, choice_config, tune
    from engine.worker.tuned import apply_policy

    folder = model_folder(args)
    offload, calibration = calibrated_offload(args, folder, offload_config(args))
    model = load_model(folder, offload)
    try:
        draft_model = args.draft_model or bundled_draft(model)  # as `generate` and the tune find it
        result = tune(model, TuneConfig(draft_model=draft_model, retune=args.retune))
        choice = result.choice
        prompt_ids = encode_prompts(model, PROMPTS[: args.prompts])
        default = greedy(args.new_tokens)
        applied = choice_config(default, choice, draft_model)
        fixed = choice_config(default, choice, draft_model, adapt_draft_len=False)
        apply_policy(model, choice.policy)  # the default runs under it too: only the decoding differs
        configs = {"default": default, "tuned, fixed γ": fixed, "tuned, as applied": applied}
        generate_text(model, prompt_ids[0], replace(applied, max_new_tokens=4))  # warm-up: the drafter
        passes = {name: [] for name in configs}
        outputs = {}
        for _ in range(args.repeats):  # alternating, so drift on a shared host hits all alike
            for name, gen in configs.items():
                runs = [generate_text(model, ids, gen) for ids in prompt_ids]
                passes[name].append(statistics.median(r.stats.tpot_ms for r in runs))
                outputs[name] = [r.token_ids for r in runs]
        predicted = _predicted_tpot(result)
        info = model.info()
    finally:
        model.close()
    tpot = {name: statistics.median(times) for name, times in passes.items()}
    default_ms, fixed_ms, applied_ms = tpot.values()
    return {
        "model": asdict(info),
        "simulated_link": info.simulated_link,
        "calibration": calibration,
        "choice": asdict(choice),
        "reused_tuning": result.reused,
        "rows": [{"name": name, "tpot_ms": ms, "tokens_per_s": 1e3 / ms} for name, ms in tpot.items()],
        "speedup": default_ms / applied_ms,  # the settings the app applies
        "speedup_fixed_draft_len": default_ms / fixed_ms,
        # the analytic model predicts the configuration the search measured: a fixed draft length
        "predicted_tuned_tpot_ms": predicted,
        "prediction_error": abs(predicted - fixed_ms) / fixed_ms,
        "same_tokens": all(tokens == outputs["default"] for tokens in outputs.values()),
    }


def calibrated_offload(args, folder: str, offload):
    """`--sim-link calibrated`: the offload config on a link calibrated to this host, and the
    calibration; otherwise the config as given and None."""
    from engine.bench.compare import LINK_RATIO, calibrate_link
    from engine.loader import load_model
    from engine.prompts import PROMPTS, encode_prompts

    if args.sim_link != "calibrated":
        return offload, None
    probe_model = load_model(folder, offload)
    try:
        prompt_ids = encode_prompts(probe_model, PROMPTS[: args.prompts])
    finally:
        probe_model.close()
    gbps, layer_ms = calibrate_link(folder, offload, prompt_ids, args.new_tokens)
    calibration = {"layer_ms": layer_ms, "link_gbps": gbps, "copy_over_layer": LINK_RATIO}
    return replace(offload, sim_link_gbps=gbps, sim_latency_us=0.0), calibration  # as --compare's link


def _predicted_tpot(result) -> float:
    """The analytic model's TPOT for the chosen settings (a fixed draft length, as searched)."""
    from engine.tune.analytic import drafter_profiles, predict_plain_tpot, predict_tpot

    choice = result.choice
    profiles = dict(drafter_profiles(result.profile))
    profile = profiles.get(choice.drafter, result.profile)
    if choice.draft_len > 0:
        cutoff, draft_len = choice.cutoff_layer, choice.draft_len
        return predict_tpot(profile, result.probe, choice.cache_experts, cutoff, draft_len)
    return predict_plain_tpot(profile, result.probe, choice.cache_experts)


def format_tuned(result: dict) -> str:
    c = result["choice"]
    lines = [
        f"tuned: {c['drafter'] or 'no drafter'}, cutoff layer {c['cutoff_layer']}, draft length "
        f"{c['draft_len']}, {c['cache_experts']} cached experts"
        + (f", {c['prefetch']} prefetch" if c["prefetch"] else "")
        + (f", {c['policy'].upper()} cache" if c["policy"] else "")
        + (" (stored tuning)" if result["reused_tuning"] else ""),
        f"{'configuration':<20}{'tpot_ms':>10}{'tok/s':>9}",
    ]
    lines += [f"{r['name']:<20}{r['tpot_ms']:>10.2f}{r['tokens_per_s']:>9.1f}" for r in result["rows"]]
    lines.append(
        f"speedup {result['speedup']:.2f}× as applied ({result['speedup_fixed_draft_len']:.2f}× with the "
        f"draft length fixed); predicted fixed-γ tpot {result['predicted_tuned_tpot_ms']:.2f} ms "
        f"({result['prediction_error']:.0%} off); same tokens: {'yes' if result['same_tokens'] else 'NO'}"
    )
    if result["simulated_link"]:
        lines.append("SIMULATED link (no GPU): these timings are simulated, not a real PCIe measurement.")
    return "\n".join(lines)
