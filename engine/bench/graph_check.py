"""The whole decode step as one CUDA graph against the eager step, on the tiny model of every
supported family: `python -m engine.bench.graph_check OUT.json [--dtype float32 bfloat16]`.

For each family (`engine.tiny.models`) and dtype: a model holding every expert on the GPU decodes
`STEPS` greedy tokens after a fixed prompt through the graph (`engine.decode.captured_step`), then
the same through the eager paths; the JSON says whether the tokens are equal, the largest
|Δlogits| (and the logits' scale), how many times the step was captured, the path the steps took,
the pieces of the decoder the fused kernels computed (`engine.decode.fused_decoder`) and, where
the graph was refused or turned off, why, and which body it captured (the standard decoder's,
or the model's own modules); three families again with a budget that misses, the step in graph
pieces (`engine.decode.piecewise_step`), their misses copied in and then computed on the CPU
(`cpu_computed`; `tables_mapped`: whether the device reads the slot tables in pinned host
memory). A family whose steps the graph cannot hold is listed with the reason. One of the
prepared GPU check's stages (`engine.bench.gpu`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.decode.module_step import module_refusal

PROMPT = torch.tensor([3, 5, 7, 9, 11, 13])
STEPS = 12
# families also checked with a budget that misses (the step in graph pieces): a standard one, two
# whose modules the graph holds; that many slots of their 16 or 24 experts
BUDGET_FAMILIES = ("qwen3_moe", "deepseek_v2", "gpt_oss")
BUDGET_SLOTS = 6


def greedy(model) -> tuple[list[int], list[torch.Tensor]]:
    """`STEPS` greedy tokens after PROMPT through `model.decode`, and each step's logits (float32,
    on the CPU)."""
    cache = model.new_kv_cache()
    token = int(model.forward(PROMPT, cache)[-1].argmax())
    tokens, logits = [token], []
    for _ in range(STEPS):
        out = model.decode(token, cache)
        logits.append(out.to("cpu", torch.float32, copy=True))  # the step rewrites `out`
        token = int(out.argmax())
        tokens.append(token)
    return tokens, logits


def check_family(
    folder: Path,
    device: str,
    dtype: str,
    prepare=None,
    slots: int | None = None,
    cpu_experts: str | None = None,
    **options,
) -> dict:
    """One family's model decoded through the graph and eagerly; `prepare(model)` (tests: a
    stand-in capture off CUDA) runs after the load; `slots`: a budget of that many device slots
    (the step in graph pieces, engine.decode.piecewise_step), else every expert on the device;
    `cpu_experts`: the graphed run's misses computed on the CPU in that mode (the eager run's
    all on the device); `options`: more of the `OffloadConfig`."""
    from engine.loader import load_model
    from engine.moe.cpu_misses import HybridExecutor

    budget = ExpertBudget(all_experts=True) if slots is None else ExpertBudget.parse(str(slots))
    config = OffloadConfig(device=device, dtype=dtype, expert_budget=budget, **options)
    model = load_model(folder, config)
    try:
        if prepare is not None:
            prepare(model)
        step = model.captured if slots is None else model.pieces
        if step is None:
            return {"captured": False, "why": module_refusal(model.hf_config) or f"not on CUDA ({device})"}
        hybrid = HybridExecutor(model, cpu_experts) if cpu_experts else None
        with model.control.installed(hybrid=hybrid):
            tokens, logits = greedy(model)
        ran = model.paths.log.since(None)
        cpu_computed = model.cache.stats.phases["decode"].cpu_computed
        graphed = model.paths
        model.paths = graphed.without("cuda-graph", "cuda-pieces")
        want_tokens, want_logits = greedy(model)
        model.paths = graphed
        deltas = [(a - b).abs().max().item() for a, b in zip(logits, want_logits, strict=True)]
        return {
            "body": type(step.body).__name__,
            "fused_decoder": _pieces_of(step.body.fused),
            "captured": step.captures > 0,
            "captures": step.captures,
            "off_because": step.off_because,
            "step_paths": ran["step_paths"],
            "declined": ran["step_path_declined"],
            "tokens_equal": tokens == want_tokens,
            "max_abs_delta": max(deltas),
            "logits_scale": max(b.abs().max().item() for b in want_logits),
            "cpu_computed": cpu_computed,
            "tables_mapped": _tables_mapped(step),
        }
    finally:
        model.close()


def _tables_mapped(step) -> bool | None:
    """Whether the pieces' slot tables are read by the device where they lie in pinned host memory
    (engine.device_cache.mapped_table), or None for the whole-step graph."""
    pieces = getattr(step, "pieces", None)
    return None if pieces is None else all(table.mapped for table in pieces.tables.values())


def _pieces_of(fused) -> dict | None:
    """Which of the decoder's pieces the fused kernels compute (None: none)."""
    if fused is None:
        return None
    return {
        "norms": fused.norms,
        "rotary": fused.rotary,
        "attention": fused.attention,
        "routers": len(fused.routers),
    }


def run(out: Path, device: str, dtypes: list[str], families=None, prepare=None, **options) -> dict:
    """Every supported family (or those named) in `dtypes`, the JSON rewritten after each: the
    hand-tuned tiny families first (the standard decoder's, with the fused kernels), then the
    others (the model's own modules in the graph, or why not)."""
    from engine.model.adapters import SUPPORTED_MODEL_TYPES
    from engine.tiny.models import TINY_ARCHITECTURES, make_tiny_model

    report: dict = {"device": device, "steps": STEPS, "families": {}}
    others = sorted(set(SUPPORTED_MODEL_TYPES) - set(TINY_ARCHITECTURES))
    with tempfile.TemporaryDirectory() as scratch:
        for family in families or (*TINY_ARCHITECTURES, *others):
            folder = make_tiny_model(Path(scratch) / family, family)
            for dtype in dtypes:
                for slots, cpu, label in _rows(family):
                    try:
                        found = check_family(folder, device, dtype, prepare, slots, cpu, **options)
                    except Exception as err:  # one family's failure is its row, not the end
                        found = {"error": f"{type(err).__name__}: {err}"}
                    report["families"][f"{family} {dtype}{label}"] = found
                    out.write_text(json.dumps(report, indent=2))
    return report


def _rows(family: str) -> list[tuple[int | None, str | None, str]]:
    """(slots, cpu_experts, the row's name's tail) of one family's checks: every expert on the
    device; for `BUDGET_FAMILIES` also a budget that misses, its misses on the device, then on the CPU."""
    rows: list[tuple[int | None, str | None, str]] = [(None, None, "")]
    if family in BUDGET_FAMILIES:
        rows.append((BUDGET_SLOTS, None, f", {BUDGET_SLOTS} slots"))
        rows.append((BUDGET_SLOTS, "always", f", {BUDGET_SLOTS} slots, CPU misses"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.bench.graph_check", description=__doc__.splitlines()[0]
    )
    parser.add_argument("out", type=Path, help="where the JSON goes")
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    report = run(args.out, args.device, args.dtype)
    for name, found in report["families"].items():
        print(name, json.dumps(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
