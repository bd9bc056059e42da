"""Benchmark v1: `python -m engine.bench --model DIR [options]`.

Runs a fixed prompt set through the offloaded engine for each expert budget
asked for and prints one row per budget with the DESIGN.md metrics: tpot_ms,
tokens_per_s, prefill tokens/s, decode hit_rate, h2d_gbps and bytes copied per
token, and whether the link was simulated. `--compare-transformers` also times
transformers' own `generate` on the same model, device and dtype (decode time
= time for N tokens − time for 1 token, the same split the engine reports), so
the offload machinery's overhead is measured side by side.

Figures measured over a simulated link are simulated: every row says so.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict, replace
from pathlib import Path

from engine.bench import emulated, llama_cpp
from engine.bench.memory import current_rss_bytes, memory_line
from engine.bench.op_counts import measured_beside, op_count_lines
from engine.bench.passes import bench_engine, decoding_of
from engine.bench.rows import BenchRow, format_table, step_path_line
from engine.bench.side_by_side import bench_other, compare_side_by_side, ratio_line, ratios
from engine.config import ExpertBudget, OffloadConfig
from engine.errors import EngineError
from engine.options import (
    add_offload_arguments,
    add_sim_link_argument,
    add_spec_arguments,
    model_folder,
    offload_config,
)
from engine.prompts import PROMPTS, encode_prompts, lengthened

log = logging.getLogger(__name__)
FUSED_EXPERTS = {"auto": None, "on": True, "off": False}  # --fused-experts: ExpertControl.fused


def run(args: argparse.Namespace) -> dict:
    from engine.bench.tuned import calibrated_offload

    budgets = [b.strip() for b in (args.expert_budget or "all").split(",")]
    prompts = PROMPTS[: args.prompts]
    rows: list[BenchRow] = []
    if args.vs_llama_cpp:
        llama_cpp.check_available(args.vs_llama_cpp)
    # llama.cpp beside the last budget's model, their passes alternated, where memory holds both
    beside = args.vs_llama_cpp and llama_cpp.fits_beside(args.vs_llama_cpp)
    link, calibration = calibrated_offload(args, model_folder(args), offload_config(args, budgets[0]))
    if args.emulate_cuda:
        link = replace(link, sim_link_gbps=link.sim_link_gbps or emulated.SIM_LINK_GBPS)
    for index, budget in enumerate(budgets):
        baseline = current_rss_bytes()
        offload = replace(link, expert_budget=ExpertBudget.parse(budget))
        model = _loaded(args, offload)
        try:
            prompt_ids = [lengthened(ids, args.prompt_tokens) for ids in encode_prompts(model, prompts)]
            if beside and index == len(budgets) - 1:
                ours, theirs, vs = llama_cpp.side_by_side(args, model, prompt_ids, baseline)
                rows.append(ours)
            else:
                passes = (model, prompt_ids, args.new_tokens, args.repeats, baseline, decoding_of(args))
                rows.append(bench_engine(*passes))
            info = model.info()
            extras = measured_beside(args, model, prompt_ids[0])  # the last budget's are kept
        finally:
            model.close()
        print(format_table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    result = {
        "model": asdict(info),
        "new_tokens": args.new_tokens,
        "prompts": len(prompts),
        "kernels": info.kernels,  # as the load resolved --kernels
        "decoding": {"spec": args.spec, "prefetch": args.prefetch, "cpu_experts": args.cpu_experts},
        "prompt_tokens": [len(ids) for ids in prompt_ids],
    }
    if calibration is not None:
        result["calibration"] = calibration
    result.update(extras)
    if args.emulate_cuda:
        result["emulated"] = "CUDA's layout and step on the CPU (engine.bench.emulated): counts, not speed"
    if args.compare_transformers:
        # The largest cache asked for: with every expert cached, offloading is pure overhead.
        largest = max(zip(rows, budgets, strict=True), key=lambda pair: pair[0].cache_slots)[1]
        ours, theirs = compare_side_by_side(args, largest, prompt_ids, offload_config(args, largest))
        rows += [ours, theirs]
        result["speed_vs_transformers"] = ours.tokens_per_s / theirs.tokens_per_s
        result["compared_budget"] = ours.budget
    if beside:
        rows.append(theirs)
        result["llama_cpp"] = vs
    elif args.vs_llama_cpp:
        rows.append(llama_cpp.compare_llama_cpp(args, prompt_ids, rows[-1], result))
    result["rows"] = [asdict(r) for r in rows]
    return result


def _loaded(args: argparse.Namespace, offload: OffloadConfig):
    """The model with the step's options the bench was given (--emulate-cuda, --expert-graphs,
    --fused-experts, --step-graph)."""
    from engine.loader import load_model
    from engine.moe.cuda_graphs import ExpertGraphs

    if args.emulate_cuda:  # CUDA's layout, with the kernels auto gives there (ggml's are the CPU's)
        with emulated.cuda_layout():
            model = load_model(model_folder(args), replace(offload, kernels="exact"))
        emulated.step_as_on_cuda(model)  # every fused kernel asked for, unless turned off below
    else:
        model = load_model(model_folder(args), offload)
    model.control.graphs = ExpertGraphs() if args.expert_graphs else None
    if not args.emulate_cuda or args.fused_experts != "auto":
        model.control.fused = FUSED_EXPERTS[args.fused_experts]
    if args.step_graph == "off":
        model.paths = model.paths.without("cuda-graph", "cuda-pieces")
    return model


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench",
        description=__doc__.splitlines()[0],
        epilog="The rows (and --vs-llama-cpp's) decode greedily, plainly unless --spec, --prefetch or "
        "--cpu-experts say otherwise (llama.cpp's decode plainly); --compare runs every speculation and "
        "prefetch configuration side by side.",
    )
    add_offload_arguments(parser)
    parser.set_defaults(expert_budget=None)
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the fixed prompts")
    parser.add_argument("--repeats", type=int, default=3, help="passes over the prompts (median reported)")
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="make each prompt this many tokens long (its own tokens repeated before it): prefill and "
        "decode over a long context, as in a long chat",
    )
    parser.add_argument(
        "--compare-transformers", action="store_true", help="also time transformers' generate, all resident"
    )
    parser.add_argument("--json", dest="json_out", default=None, help="also write the results to this file")
    parser.add_argument(
        "--compare", action="store_true", help="every speculation × prefetch configuration side by side"
    )
    parser.add_argument("--configs", nargs="*", default=None, help="--compare: only these configurations")
    add_sim_link_argument(parser)  # calibrated, or GB/s: the same option in every command
    parser.add_argument(
        "--tuned", action="store_true", help="auto-tune, then time the tuned settings against the defaults"
    )
    parser.add_argument("--retune", action="store_true", help="--tuned: ignore a stored tuning result")
    add_spec_arguments(parser)
    parser.set_defaults(spec="none")  # the rows decode plainly unless --spec is given
    parser.add_argument(
        "--and-model",
        metavar="DIR",
        default=None,
        help="also bench this model (e.g. the same weights as BF16 safetensors) in a child process, "
        "side by side: link bytes per token, memory and speed as ratios",
    )
    parser.add_argument(
        "--multi-turn",
        action="store_true",
        help="a 4-turn conversation: prefill tokens and time per turn with and without prefix reuse",
    )
    _add_step_arguments(parser)
    parser.add_argument(
        "--vs-llama-cpp",
        metavar="FILE.gguf",
        default=None,
        help="also time llama.cpp (the optional extra 'llama') on this GGUF file, which MoE Chat runs "
        "too when --model is not given",
    )
    return parser


def _add_step_arguments(parser: argparse.ArgumentParser) -> None:
    """What a decode step launches, and how."""
    parser.add_argument(
        "--count-ops",
        action="store_true",
        help="also count, per decode token, the operators launched and the host synchronisations",
    )
    parser.add_argument(
        "--expert-graphs",
        action="store_true",
        help="CUDA, a cache holding every expert: replay each MoE layer's one-token step as a CUDA "
        "graph (engine.moe.cuda_graphs; off by default until measured)",
    )
    emulate = "CPU, TRITON_INTERPRET=1: lay out and step the model as on CUDA to count a GPU step's launches"
    parser.add_argument("--emulate-cuda", action="store_true", help=emulate + " (engine.bench.emulated)")
    graph = (
        "CUDA: one-token steps as one CUDA graph where every expert is cached, as graph pieces where "
        "the budget misses (auto), or eager (off)"
    )
    parser.add_argument("--step-graph", choices=("auto", "off"), default="auto", help=graph)
    parser.add_argument(
        "--fused-experts",
        choices=tuple(FUSED_EXPERTS),
        default="auto",
        help="every expert cached: one-token steps' experts through the fused kernels "
        "(engine.moe.fused_experts): auto on CUDA; off in torch (to time one against the other); on "
        "the CPU too (Triton's interpreter, TRITON_INTERPRET=1: for --count-ops, not speed)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.vs_llama_cpp and not args.model:
        args.model = args.vs_llama_cpp  # the very same file
    counts = (args.new_tokens >= 2, args.repeats >= 1, args.prompt_tokens >= 0)
    if not all(counts) or not 1 <= args.prompts <= len(PROMPTS):
        parser.error(
            "need --new-tokens >= 2, --repeats >= 1, --prompt-tokens >= 0 and "
            f"1 <= --prompts <= {len(PROMPTS)}"
        )
    if args.emulate_cuda and (args.device != "cpu" or (why := emulated.interpreter_off())):
        parser.error("--emulate-cuda runs on --device cpu" if args.device != "cpu" else why)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    if args.compare:
        return _main_compare(args)
    if args.multi_turn:
        return _main_multi_turn(args)
    if args.tuned:
        return _main_tuned(args)
    try:
        result = run(args)
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.and_model:
        try:
            result["and_model"] = bench_other(sys.argv[1:] if argv is None else argv, args.and_model)
            result["and_model_ratios"] = ratios(result["rows"][0], result["and_model"]["rows"][0])
        except EngineError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    _print_result(result)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


def _main_multi_turn(args) -> int:
    from engine.bench.multi_turn import bench_multi_turn, format_turns
    from engine.loader import load_model

    budget = (args.expert_budget or "all").split(",")[0]
    model = load_model(model_folder(args), offload_config(args, budget))
    try:
        rows = bench_multi_turn(model, args.new_tokens, args.repeats)
        print(f"{model.path} ({model.info().model_type}), {args.new_tokens} new tokens per turn, greedy")
    finally:
        model.close()
    print(format_turns(rows))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([asdict(r) for r in rows], indent=2))
    return 0 if all(r.same_reply for r in rows) else 1


def _print_result(result: dict) -> None:
    rows = [BenchRow(**r) for r in result["rows"]]
    info = result["model"]
    kernels = "" if result.get("kernels", "exact") == "exact" else f", {result['kernels']} kernels"
    print(f"{info['path']} ({info['model_type']}, {info['dtype']}, device {info['device']}{kernels})")
    print(format_table(rows))
    for line in filter(None, map(memory_line, rows)):
        print(line)
    for line in filter(None, map(step_path_line, rows)):
        print(line)
    for line in op_count_lines(result):
        print(line)
    if "and_model" in result:
        other = result["and_model"]
        other_rows = [BenchRow(**r) for r in other["rows"]]
        print(f"\n{other['model']['path']} ({other['model']['dtype']}), the same bench in its own process")
        print(format_table(other_rows))
        for line in filter(None, map(memory_line, other_rows)):
            print(line)
        found = result["and_model_ratios"]
        print(ratio_line(Path(info["path"]).name, Path(other["model"]["path"]).name, found))
    if "llama_cpp" in result:
        vs = result["llama_cpp"]
        print(
            f"vs llama.cpp on the same file ({vs['threads']} threads): decode {vs['decode_ratio']:.2f}x, "
            f"prefill {vs['prefill_ratio']:.2f}x ("
            + ("passes alternated; " if vs.get("alternated") else "llama.cpp's passes after MoE Chat's; ")
            + f"llama.cpp's tpot spread over passes {vs['their_spread']:.0%})"
        )
        if "pairs" in vs:
            print(
                f"  pass by pass, the median of {vs['pairs']} alternated pairs' ratios: "
                f"decode {vs['paired_decode_ratio']:.2f}x, prefill {vs['paired_prefill_ratio']:.2f}x"
            )
    if "speed_vs_transformers" in result:
        print(
            f"decode speed with {result['compared_budget']} cached: "
            f"{result['speed_vs_transformers']:.1%} of transformers' generate"
        )


def _main_tuned(args: argparse.Namespace) -> int:
    from engine.bench.tuned import format_tuned, run_tuned

    return _report(args, run_tuned, format_tuned)


def _main_compare(args: argparse.Namespace) -> int:
    from engine.bench.compare import format_compare, run_compare

    return _report(args, run_compare, format_compare)


def _report(args: argparse.Namespace, run_bench, format_result) -> int:
    """Run one of the side-by-side benchmarks, print its table, and write its JSON if asked."""
    try:
        result = run_bench(args)
    except EngineError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_result(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
