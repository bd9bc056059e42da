"""Command line: `python -m engine generate …` and `python -m engine make-tiny …`.

`generate` loads a model folder with its experts offloaded and streams the
reply to stdout; with `--json` it prints one JSON object instead:
`{"text", "token_ids", "finish_reason", "stats": {tpot_ms, tokens_per_s,
hit_rate, h2d_bytes, misses, hits, simulated_link, …}, "model": {…}}`.
Bad input exits with status 2 and the error on stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import sys
from dataclasses import asdict

from engine.errors import EngineError
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig

log = logging.getLogger(__name__)


def add_offload_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that loads a model."""
    parser.add_argument(
        "--model", default=None, help="Hugging Face model folder (default: the bundled demo model)"
    )
    parser.add_argument(
        "--expert-budget",
        default=None,
        help="device memory for cached experts: a size (2GiB, 512MB), a number of experts (64), or 'all'",
    )
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    parser.add_argument("--policy", default="lru", choices=("lru", "lfu", "mrs"), help="cache eviction")
    parser.add_argument(
        "--expert-dtype",
        default="native",
        choices=("native", "int8", "int4"),
        help="routed experts' precision in host memory: int8/int4 copy fewer bytes but change outputs",
    )
    parser.add_argument(
        "--sim-link-gbps",
        type=float,
        default=None,
        help="without a GPU: simulate a host→device link of this many GB/s",
    )
    parser.add_argument("--sim-latency-us", type=float, default=10.0, help="simulated link latency per copy")


def add_spec_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding and expert prefetch options."""
    parser.add_argument(
        "--spec",
        default="none",
        choices=("none", "draft", "self", "substitute"),
        help="speculative decoding: a draft model, the target's own top-r experts (SS-MoE), "
        "or resident low-bit substitute experts (SubSpec)",
    )
    parser.add_argument(
        "--draft-model", default=None, help="draft model folder (default: the demo draft for the demo model)"
    )
    parser.add_argument("--draft-len", type=int, default=4, help="draft tokens per verify step (start value)")
    parser.add_argument("--fixed-draft-len", action="store_true", help="never adapt the draft length")
    parser.add_argument("--max-draft-len", type=int, default=16)
    parser.add_argument("--top-r", type=int, default=1, help="--spec self: experts per token while drafting")
    parser.add_argument(
        "--cached-only", action="store_true", help="--spec self: draft from cached experts only"
    )
    parser.add_argument("--substitute-bits", type=int, default=4, choices=(4, 8))
    parser.add_argument(
        "--tau",
        type=float,
        default=SpecConfig.confidence_tau,
        help="end a draft at a token the draft gives less than this probability (0: never)",
    )
    parser.add_argument(
        "--adaptive-accept",
        action="store_true",
        help="SS-MoE adaptive acceptance: faster, NOT lossless (outputs may differ from the model's)",
    )
    parser.add_argument("--prefetch", default="none", choices=("none", "next-layer", "hybrimoe", "spmoe"))
    parser.add_argument(
        "--cutoff", type=int, default=None, help="spmoe: last MoE layer prefetched (default: auto)"
    )
    parser.add_argument(
        "--cpu-experts",
        default="never",
        choices=("auto", "never", "always"),
        help="compute missing experts on the CPU when the measured cost model says it is sooner (GPU only)",
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens: int = 128) -> None:
    """Sampling and length options of a generation request."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--greedy", action="store_true", help="always take the most likely token")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-new-tokens (benchmarks, tests)"
    )


def generation_config(args: argparse.Namespace) -> GenerationConfig:
    """The GenerationConfig the sampling and speculation options say (imports no torch)."""
    return GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        sampling=SamplingConfig(
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            repetition_penalty=args.repetition_penalty,
            seed=args.seed,
            greedy=args.greedy,
        ),
        stop_strings=tuple(args.stop),
        ignore_eos=args.ignore_eos,
        spec=spec_config(args),
        prefetch=args.prefetch,
        cutoff=args.cutoff,
        cpu_experts=args.cpu_experts,
    )


def spec_config(args: argparse.Namespace) -> SpecConfig:
    """The SpecConfig the options say; `--spec draft` on the demo model drafts with the demo draft."""
    draft_model = args.draft_model
    if args.spec == "draft" and draft_model is None and not args.model:
        from engine.resources import demo_draft_dir

        draft_model = str(demo_draft_dir())
    return SpecConfig(
        mode=args.spec,
        draft_model=draft_model,
        draft_len=args.draft_len,
        adapt_draft_len=not args.fixed_draft_len,
        max_draft_len=args.max_draft_len,
        top_r=args.top_r,
        cached_only=args.cached_only,
        substitute_bits=args.substitute_bits,
        confidence_tau=args.tau,
        acceptance="adaptive" if args.adaptive_accept else "lossless",
    )


def model_folder(args: argparse.Namespace) -> str:
    """--model, or the bundled demo model when none is given."""
    if args.model:
        return args.model
    from engine.resources import demo_model_dir

    return str(demo_model_dir())


def offload_config(args: argparse.Namespace, expert_budget: str | None = None):
    """The OffloadConfig the options say; `expert_budget` overrides --expert-budget (bench sweeps)."""
    from engine.config import ExpertBudget, OffloadConfig

    return OffloadConfig(
        device=args.device,
        dtype=args.dtype,
        expert_budget=ExpertBudget.parse(expert_budget if expert_budget is not None else args.expert_budget),
        policy=args.policy,
        sim_link_gbps=args.sim_link_gbps,
        sim_latency_us=args.sim_latency_us,
        expert_dtype=args.expert_dtype,
    )


def _generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to one prompt")
    add_offload_arguments(p)
    p.add_argument("--prompt", required=True, help="one user message (raw text if the model has no template)")
    add_sampling_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object with text, ids and stats")
    add_spec_arguments(p)


def _make_tiny_parser(sub) -> None:
    # engine.tiny_models imports transformers (seconds); the registry's list is the same and light,
    # so a mistyped option fails at once.
    from engine.models import SUPPORTED_MODEL_TYPES

    p = sub.add_parser("make-tiny", help="write a tiny random MoE model (for smoke tests)")
    p.add_argument("out", help="folder to create")
    p.add_argument("--arch", default="qwen3_moe", choices=SUPPORTED_MODEL_TYPES)
    p.add_argument("--seed", type=int, default=0)


def _tune_parser(sub) -> None:
    p = sub.add_parser("tune", help="measure this machine and model; choose cutoff, draft length and cache")
    add_offload_arguments(p)
    p.add_argument("--sim-link", dest="sim_link_gbps", type=float, help="same as --sim-link-gbps")
    p.add_argument(
        "--draft-model", default=None, help="draft model folder (default: the demo draft for the demo model)"
    )
    p.add_argument("--new-tokens", type=int, default=32, help="tokens per calibration prompt and point")
    p.add_argument("--retune", action="store_true", help="measure again even if a stored result matches")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run_tune(args: argparse.Namespace) -> int:
    offload = offload_config(args)
    offload.validate()

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
        c = result.choice
        print(
            f"cutoff layer {c.cutoff_layer}, draft length {c.draft_len}, {c.cache_experts} cached experts: "
            f"{c.expected_tokens_per_s:.1f} tok/s expected" + (" (stored result)" if result.reused else "")
        )
    return 0


def _tune_progress(quiet: bool):
    def report(stage: str, done: int, total: int) -> None:
        if not quiet:
            print(f"\r{stage}: {done}/{total}", end="", file=sys.stderr, flush=True)

    return report


def run_generate(args: argparse.Namespace) -> int:
    offload = offload_config(args)
    offload.validate()  # before the heavy imports below: a bad option fails at once

    from engine.generation import FinishedEvent, generate
    from engine.loader import load_model

    gen_config = generation_config(args)
    gen_config.validate()
    model = load_model(model_folder(args), offload)
    try:
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
            link = "simulated link" if s.simulated_link else "PCIe"
            spec = f", accept_len {s.accept_len:.2f}" if s.accept_len else ""
            print(f"\n[{finished.reason}; {s.generated_tokens} tokens, {tps}, hit rate {hit}{spec}, {link}]")
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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        if args.command == "generate":
            return run_generate(args)
        if args.command == "tune":
            return run_tune(args)
        from engine.tiny_models import make_tiny_model

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
