"""How many kernels a decode step launches and how often it waits on the device (`--count-ops`).

Contract: `count_ops(model, prompt_ids, new_tokens)` generates greedily twice under torch's
profiler, once with two new tokens (the prefill's and one decode step's: a first step prepares what
later ones reuse) and once with `new_tokens`, and returns the difference per further token: `ops`
(leaf aten operators dispatched, each one kernel launch on a GPU and one call through the
dispatcher on the CPU), `kernels` (launches of the
engine's own kernels, `engine.gpu`: Triton's, or its cubins through the CUDA driver, which torch's
profiler sees only as the ranges `engine.gpu.launch_ranges` opens; one launch each, the operators
inside a range left out — on the CPU they are Triton's interpreter copying its arguments),
`launches` (the operators and kernels that launch work on a GPU: the deepest operator of each
call that is not a view or an allocation — a matmul whose leaves are conjugation checks counts
once, a view or an empty tensor not at all — plus `kernels`), `host_syncs` (the host reading a
tensor's values — `.item()`, `.tolist()`, `nonzero` — each a wait for the device on a GPU; on
the CPU it counts where those waits would be) and, on CUDA, the
runtime's own `cuda_launches` and `cuda_syncs` (None on the CPU). These are what CUDA graphs, a
static cache and fused kernels would remove.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

from engine.generation import generate_text
from engine.gpu.launch_ranges import RANGE_PREFIX
from engine.prompts import greedy

# aten operators that copy a device value to the host (and so wait for the device)
# `.item()`, `int(t)`, `bool(t)` dispatch `_local_scalar_dense`; `.tolist()` and `.numpy()` (the
# greedy argmax on the CPU) dispatch nothing and are counted apart
HOST_READS = ("aten::_local_scalar_dense", "aten::nonzero", "aten::equal", "aten::is_nonzero")
CUDA_LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")
# aten operators that launch nothing on a GPU: views, metadata, allocations
NO_LAUNCH = frozenset(
    f"aten::{name}"
    for name in (
        *("view", "_unsafe_view", "_reshape_alias", "reshape", "as_strided", "alias", "expand", "t"),
        *("transpose", "permute", "slice", "select", "unsqueeze", "squeeze", "unbind", "split"),
        *("narrow", "detach", "lift_fresh", "resolve_conj", "resolve_neg", "empty", "empty_strided"),
        *("empty_like", "contiguous", "to", "_to_copy"),
    )
)


@contextmanager
def _value_reads() -> Iterator[Counter]:
    """Count `Tensor.tolist()` and `Tensor.numpy()` calls, which read a tensor's values without
    dispatching an operator."""
    reads: Counter = Counter()
    own = {name: torch.Tensor.__dict__.get(name) for name in ("tolist", "numpy")}
    for name in own:
        method = getattr(torch.Tensor, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            reads[_name] += 1
            return _method(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)
    try:
        yield reads
    finally:
        for name, method in own.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)


def _counts(model, prompt_ids: list[int], new_tokens: int) -> dict[str, int | None]:
    cuda = model.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    model.prefix_cache.clear()  # each run prefills the whole prompt
    with profile(activities=activities) as prof, _value_reads() as reads:
        generate_text(model, prompt_ids, greedy(new_tokens))
    model.prefix_cache.clear()
    events = [e for e in prof.events() if not _inside_kernel(e)]
    leaves = [
        e
        for e in events
        if e.name.startswith("aten::")
        and not any(child.name.startswith("aten::") for child in e.cpu_children)
    ]
    return {
        "ops": len(leaves),
        "kernels": sum(e.name.startswith(RANGE_PREFIX) for e in events),
        "launches": sum(_launches(e) for e in events) + sum(e.name.startswith(RANGE_PREFIX) for e in events),
        "host_syncs": sum(e.name in HOST_READS for e in events) + sum(reads.values()),
        "cuda_launches": sum(e.name in CUDA_LAUNCHES for e in events) if cuda else None,
        "cuda_syncs": sum(e.name.endswith("Synchronize") for e in events) if cuda else None,
    }


def _launches(event) -> bool:
    """Whether `event` is an operator that launches work on a GPU: not a view or an allocation, and
    none of the operators it calls does (it is the deepest that does)."""
    if not event.name.startswith("aten::") or event.name in NO_LAUNCH:
        return False
    return not any(c.name.startswith("aten::") and c.name not in NO_LAUNCH for c in event.cpu_children)


def _inside_kernel(event) -> bool:
    """Whether `event` ran inside a launch of one of the engine's kernels (`launch_ranges`)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(RANGE_PREFIX):
            return True
        parent = parent.cpu_parent
    return False


def count_ops(model, prompt_ids: list[int], new_tokens: int) -> dict[str, float | None]:
    """Per decode token after the first decode step (where one is left to count): operators launched
    and host synchronisations. A reply's first decode step prepares what the others reuse (a ggml
    graph, a CUDA graph's capture over the new KV buffers): both runs take it, so it cancels."""
    generate_text(model, prompt_ids, greedy(2))  # warm-up: first-call allocations are not counted
    settled = 2 if new_tokens >= 3 else 1  # tokens of the first run: the prefill's, then one step's
    first = _counts(model, prompt_ids, settled)
    full = _counts(model, prompt_ids, new_tokens)
    steps = new_tokens - settled
    return {key: None if full[key] is None else (full[key] - first[key]) / steps for key in full}


def format_op_counts(counts: dict[str, float | None]) -> str:
    line = (
        f"per decode token: {counts['ops']:.0f} operators launched, {counts.get('kernels', 0):.0f} fused "
        f"kernels, {counts.get('launches', 0):.0f} GPU launches in all, {counts['host_syncs']:.1f} host syncs"
    )
    if counts.get("cuda_launches") is not None:
        line += f" (CUDA: {counts['cuda_launches']:.0f} kernel launches, {counts['cuda_syncs']:.1f} syncs)"
    return line


def measured_beside(args, model, prompt_ids: list[int]) -> dict:
    """--count-ops' counts, the CUDA graphs' captures (or why they were turned off), and the
    pieces' planning time a layer over the timed runs (taken before the counting's profiled runs),
    whether the device reads their slot tables in pinned host memory, and how many missed experts
    the CPU computed in the last run's decode."""
    extras: dict = {}
    pieces = None if model.pieces is None else model.pieces.pieces
    plan = None if pieces is None or not pieces.planned else round(pieces.plan_us_per_layer, 1)
    cpu_computed = model.cache.stats.phases["decode"].cpu_computed if model.cache is not None else 0
    if args.count_ops:
        extras["op_counts"] = count_ops(model, prompt_ids, args.new_tokens)
    steps = (
        ("expert_graphs", model.control.graphs),
        ("step_graph", model.captured),
        ("step_pieces", model.pieces),
    )
    for name, graphs in steps:
        if graphs is not None:
            extras[name] = {"captures": graphs.captures, "off_because": graphs.off_because}
    if plan is not None:
        extras["step_pieces"]["plan_us_per_layer"] = plan
    if pieces is not None:
        mapped = all(table.mapped for table in pieces.tables.values())
        extras["step_pieces"] |= {"tables_mapped": mapped, "cpu_computed": cpu_computed}
    return extras


def op_count_lines(result: dict) -> list[str]:
    """The bench's lines for `measured_beside`'s figures in `result`."""
    lines = [format_op_counts(result["op_counts"])] if "op_counts" in result else []
    if "emulated" in result:
        lines.append(f"emulated: {result['emulated']}")
    names = (
        ("expert_graphs", "expert CUDA graphs"),
        ("step_graph", "the step as one CUDA graph"),
        ("step_pieces", "the step as CUDA graph pieces"),
    )
    for name, what in names:
        if name in result:
            graphs = result[name]
            off = f", turned off: {graphs['off_because']}" if graphs["off_because"] else ""
            plan = graphs.get("plan_us_per_layer")
            planned = "" if plan is None else f", the host's planning {plan} µs a MoE layer between pieces"
            if graphs.get("cpu_computed"):
                planned += f", {graphs['cpu_computed']} missed experts computed on the CPU"
            lines.append(f"{what}: {graphs['captures']} captures{off}{planned}")
    return lines
