"""Command line: `python -m engine generate …`, `tune …`, `fit …` and `make-tiny …`.

`generate` loads a model folder with its experts offloaded and streams the
reply to stdout; with `--json` it prints one JSON object instead:
`{"text", "token_ids", "finish_reason", "stats": {tpot_ms, tokens_per_s,
hit_rate, h2d_bytes, misses, hits, simulated_link, spec, prefetch, accept_len, …},
"model": {…}}`. With no options it speculates with the model's drafter and
prefetches with SP-MoE (`--spec auto --prefetch auto`, see `engine.options`).
`tune` prints each measured point (median ms/token, spread, runs), the choice
with its drafter, and how sure the choice is; with `--json` the whole result.
`fit MODEL` says whether a model folder or GGUF file fits this computer and where it would live,
in the words of the app's model picker (engine.model.fit_estimate), reading headers only.
Bad input exits with status 2 and the error on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
from dataclasses import asdict, replace
from pathlib import Path

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import EngineError
from engine.model.fit_estimate import CONTEXT_TOKENS
from engine.options import (
    add_offload_arguments,
    add_sampling_arguments,
    add_sim_link_argument,
    add_spec_arguments,
    generation_config,
    model_folder,
    offload_config,
    wants_calibrated_link,
)

log = logging.getLogger(__name__)


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to one prompt")
    add_offload_arguments(p)
    add_sim_link_argument(p)
    p.add_argument("--prompt", required=True, help="one user message (raw text if the model has no template)")
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    add_spec_arguments(p)


def _make_tiny_parser(sub) -> None:
    # engine.tiny.models imports transformers (seconds); the registry's list is the same and light,
    # so a mistyped option fails at once.
    from engine.model.adapters import SUPPORTED_MODEL_TYPES

    p = sub.add_parser("make-tiny", help="write a tiny random MoE model (for smoke tests)")
    p.add_argument("out", help="folder to create")
    p.add_argument("--arch", default="qwen3_moe", choices=SUPPORTED_MODEL_TYPES)
    p.add_argument("--seed", type=int, default=0)


def _tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure this machine and model; choose cutoff, draft length and cache")
    add_offload_arguments(p)
    add_sim_link_argument(p)
    p.add_argument(
        "--draft-model", default=None, help="draft model folder (default: the demo draft for the demo model)"
    )
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per calibration prompt and point")
    p.add_argument("--retune", action="store_true", help="measure again even if a stored result matches")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _fit_parser(sub) -> None:
    p = sub.add_parser("fit", help="whether a model folder or GGUF file fits this computer, and where")
    p.add_argument("model", help="a model folder, or a .gguf file (a split set's first part)")
    p.add_argument(
        "--ctx-size", type=int, default=CONTEXT_TOKENS, help="the context its KV cache is counted for"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_fit(args: argparse.Namespace) -> int:
    """The fit estimate of a model on disk: its headers read, this computer's RAM and GPU memory."""
    from engine.model.check import check_model_folder
    from engine.model.fit_estimate import ModelBytes, estimate_fit, machine_memory
    from engine.model.folder import open_checkpoint
    from engine.model.kv_size import KvShape

    check = check_model_folder(args.model)
    if not check.ok:
        print("error: " + "\n".join(check.problems), file=sys.stderr)
        return 2
    hf_config, checkpoint = open_checkpoint(Path(args.model).expanduser())
    checkpoint.close()
    kv = KvShape.from_config(hf_config.get_text_config().to_dict()).nbytes(args.ctx_size)
    ram, vram = machine_memory()
    model = ModelBytes(check.expert_bytes, check.resident_bytes, kv, check.float_experts)
    fit = estimate_fit(model, ram, vram, args.ctx_size)
    if args.json:
        print(json.dumps({"model": asdict(model), "ram_bytes": ram, "vram_bytes": vram, "fit": asdict(fit)}))
    else:
        print(f"{check.name or check.path}: {fit.summary}")
    return 0 if fit.fits_in_ram else 1


def checked_offload(args: argparse.Namespace) -> OffloadConfig:
    """The offload options, validated, with a `--sim-link calibrated` link measured on this host."""
    offload = offload_config(args)
    offload.validate()  # before the heavy imports: a bad option fails at once
    if not wants_calibrated_link(args):
        return offload
    from engine.loader import resolve_device

    if resolve_device(offload.device).type == "cuda":
        log.warning("--sim-link is ignored on a CUDA device: copies use the real link.")
        return offload
    return calibrated_link(model_folder(args), offload)


def calibrated_link(folder: str, offload: OffloadConfig) -> OffloadConfig:
    """`offload` on a simulated link where one expert's copy takes 3× one layer's decode here."""
    from engine.bench.compare import calibrate_link
    from engine.loader import load_model
    from engine.prompts import PROMPTS, encode_prompts

    probe = load_model(folder, replace(offload, expert_budget=ExpertBudget.parse("all")))
    try:
        prompt_ids = encode_prompts(probe, PROMPTS[:2])
    finally:
        probe.close()
    gbps, layer_ms = calibrate_link(folder, offload, prompt_ids, 16)
    print(f"calibrated link: {gbps:.3f} GB/s (one layer decodes in {layer_ms:.2f} ms)", file=sys.stderr)
    return replace(offload, sim_link_gbps=gbps, sim_latency_us=0.0)


def run_tune(args: argparse.Namespace) -> int:
    offload = checked_offload(args)

    from engine.loader import load_model
    from engine.tune.run import TuneConfig, tune

    draft_model = args.draft_model
    if draft_model is None and not args.model:
        from engine.resources import demo_draft_dir

        draft_model = str(demo_draft_dir())
    config = TuneConfig(draft_model=draft_model, new_tokens=args.new_tokens, retune=args.retune)
    model = load_model(model_folder(args), offload)
    try:
        result = tune(model, config, progress=_tune_progress(args.json))
    finally:
        model.close()
    if not args.json:
        print(file=sys.stderr)  # end the progress line
    report = {
        "probe": asdict(result.probe),
        "profile": asdict(result.profile),
        "prediction": asdict(result.prediction),
        "measured": [asdict(point) for point in result.measured],
        "choice": asdict(result.choice),
        "reused": result.reused,
    }
    if args.json:
        print(json.dumps(report))
    else:
        print("\n".join(tune_summary(result)))
    return 0


def tune_summary(result) -> list[str]:
    """A tune result in lines a person reads: each measured point by drafter (median, spread, runs)
    with the analytic prediction beside it, then the choice, how sure it is and why it won."""
    from engine.tune.search import DRAFTERS, describe, predicted

    lines = ["measured ms/token (median of the runs, low–high), the analytic model's beside it:"]
    points = sorted(
        result.measured, key=lambda p: (p.drafter, p.draft_len, p.cutoff_layer, p.prefetch, p.policy)
    )
    width = max((len(describe(point)) for point in points), default=0)
    drafter = None
    for point in points:
        if point.drafter != drafter:
            drafter = point.drafter
            lines.append(f"  {DRAFTERS.get(drafter, drafter) if drafter else 'no drafter'}:")
        spread = f"{point.tpot_low_ms:.1f}–{point.tpot_high_ms:.1f}" if point.tpot_low_ms is not None else "–"
        guess = predicted(result.prediction, point)
        analytic = f"predicted {guess:.1f}" if guess is not None else "not predicted"
        lines.append(
            f"    {describe(point):<{width}} {point.tpot_ms:8.1f}  ({spread}, {point.runs} runs; {analytic})"
        )
    c = result.choice
    lines.append(
        f"chosen: {describe(c)}; {c.cache_experts} cached experts: "
        f"{c.expected_tokens_per_s:.1f} tok/s expected" + (" (stored result)" if result.reused else "")
    )
    lines += [line for line in (c.certainty, c.why) if line]
    return lines


def _tune_progress(quiet: bool):
    def report(stage: str, done: int, total: int) -> None:
        if not quiet:
            print(f"\r{stage}: {done}/{total}", end="", file=sys.stderr, flush=True)

    return report


def run_generate(args: argparse.Namespace) -> int:
    gen_config = generation_config(args)
    gen_config.validate()
    offload = checked_offload(args)

    from engine.generation import FinishedEvent, generate
    from engine.loader import load_model
    from engine.worker.tuned import tuned_config

    model = load_model(model_folder(args), offload)
    try:
        gen_config = tuned_config(model, gen_config)  # `auto`: drafter, SP-MoE, as tuned
        for event in generate(model, args.prompt, gen_config):
            if isinstance(event, FinishedEvent):
                finished = event
            elif not args.json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        if args.json:
            result = {
                "text": finished.text,
                "token_ids": list(finished.token_ids),
                "finish_reason": finished.reason,
                "stats": finished.stats.to_dict(),
                "model": asdict(model.info()),
            }
            print(json.dumps(result, ensure_ascii=False))
        else:
            sys.stdout.write(finished.tail)
            s = finished.stats
            tps = f"{s.tokens_per_s:.1f} tok/s" if s.tokens_per_s else "n/a tok/s"
            hit = f"{s.hit_rate:.0%}" if s.hit_rate is not None else "n/a"
            link = "CPU, no link" if model.cache.in_place else "PCIe"
            link = "simulated link" if s.simulated_link else link
            spec = f", spec {s.spec}" + (f", accept_len {s.accept_len:.2f}" if s.accept_len else "")
            print(
                f"\n[{finished.reason}; {s.generated_tokens} tokens, {tps}, hit rate {hit}{spec}, "
                f"prefetch {s.prefetch}, {link}]"
            )
    finally:
        model.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    multiprocessing.freeze_support()
    parser = argparse.ArgumentParser(prog="python -m engine", description="MoE Chat engine")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    _make_tiny_parser(sub)
    _tune_parser(sub)
    _fit_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if args.command in ("generate", "tune"):
            from engine.worker.entry import quiet_progress_bars

            quiet_progress_bars()  # a draft model loading mid-reply would print a bar into the reply
        if args.command == "generate":
            return run_generate(args)
        if args.command == "tune":
            return run_tune(args)
        if args.command == "fit":
            return run_fit(args)
        from engine.tiny.models import make_tiny_model

        path = make_tiny_model(args.out, model_type=args.arch, seed=args.seed)
        print(path)
        return 0
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
