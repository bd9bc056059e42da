"""`run(limit)`: every ahead-of-time kernel proven on a GPU, `python -m engine.bench.gpu`'s "kernels"
stage.

Contract: `CASES` lists the checks, each the registered kernels it launches (together they cover
`engine.gpu.registry.REGISTRY`, a test holds them to it) and how its case is built
(`experts`, `decoder`). `run` measures the card's device-to-device copy rate, then builds each
case at a Qwen3-30B-A3B layer's shapes and runs its launches through the cubins
(`CubinKernel.load`, the CUDA driver): one JSON entry a kernel (a kernel checked in several
cases, `kernel (variant)`) with its outputs' errors against torch's reference, whether they are
within tolerance, its time a launch (CUDA events around a CUDA graph of launches: no launch
overhead) and, for a bandwidth-bound kernel, the bytes it reads a second against the copy rate.
An error is its kernel's entry (a CUDA error that breaks the context fails every later check:
the first error is the one to read); no check starts after `limit` seconds, and the entries of
those not run say so. `summary` comes first.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT

from engine.gpu.checks.case import QWEN3, Case, Launch, Shapes, run_case
from engine.gpu.checks.decoder import attention_case, norm_case, rope_case, router_case, smoke_case
from engine.gpu.checks.experts import (
    CLAMPED,
    FP8_SCALES,
    ROUTED,
    clamped_case,
    fp8_case,
    int4_case,
    kquant_case,
)
from engine.gpu.registry import (
    DECODER_DTYPES,
    DECODER_HEAD_DIMS,
    INT4_VARIANTS,
    KQUANT_DTYPES,
    KQUANT_TYPES,
    SMOKE,
    fp8_name,
    int4_name,
    int4_variant,
    kquant_name,
)

TIMED_LAUNCHES = 64  # launches a CUDA graph holds, at least (a whole number of turns)
REPLAYS = 5


@dataclass(frozen=True)
class CaseSpec:
    """One check: the kernels its case launches, and how it is built on a device."""

    label: str
    kernels: tuple[str, ...]
    build: Callable[[Shapes, str, np.random.Generator], Case]
    variant: str | None = None  # entries keyed `kernel (variant)`: the kernel has several cases

    def key(self, kernel: str) -> str:
        return kernel if self.variant is None else f"{kernel} ({self.variant})"


def _at_head_dim(head_dim: int, build: Callable) -> Callable:
    return lambda shapes, device, rng: build(dataclasses.replace(shapes, head_dim=head_dim), device, rng)


def _expert_cases(dtype: str) -> list[CaseSpec]:
    specs = []
    for ggml_type in KQUANT_TYPES:
        names = tuple(kquant_name(k, ggml_type, dtype) for k in (*ROUTED, "quantized_gemv"))
        specs.append(CaseSpec(f"{ggml_type.name} {dtype}", names, partial(kquant_case, ggml_type, dtype)))
    for scales in FP8_SCALES:
        names = tuple(fp8_name(k, dtype) for k in (*ROUTED, "quantized_gemv"))
        specs.append(CaseSpec(f"FP8 {scales} {dtype}", names, partial(fp8_case, scales, dtype), scales))
    for fmt, act_order in INT4_VARIANTS:
        names = tuple(int4_name(k, fmt, act_order, dtype) for k in ROUTED)
        label = f"{int4_variant(fmt, act_order)} {dtype}"
        specs.append(CaseSpec(label, names, partial(int4_case, fmt, act_order, dtype)))
    names = tuple(kquant_name(k, QT.MXFP4, dtype) for k in CLAMPED)
    specs.append(CaseSpec(f"gpt-oss MXFP4 {dtype}", names, partial(clamped_case, dtype)))
    return specs


def _decoder_cases(dtype: str) -> list[CaseSpec]:
    specs = [
        CaseSpec(f"add_rms_norm {dtype}", (f"add_rms_norm_{dtype}",), partial(norm_case, True, dtype)),
        CaseSpec(f"rms_norm {dtype}", (f"rms_norm_{dtype}",), partial(norm_case, False, dtype)),
        CaseSpec(f"router_top_k {dtype}", (f"router_top_k_{dtype}",), partial(router_case, dtype)),
    ]
    for d in DECODER_HEAD_DIMS:
        for qk_norm in (False, True):
            name = f"rope_kv_write{'_qk_norm' if qk_norm else ''}_d{d}_{dtype}"
            specs.append(CaseSpec(name, (name,), _at_head_dim(d, partial(rope_case, qk_norm, dtype))))
        names = tuple(f"decode_attention_{step}_d{d}_{dtype}" for step in ("split", "reduce"))
        specs.append(
            CaseSpec(f"decode_attention d{d} {dtype}", names, _at_head_dim(d, partial(attention_case, dtype)))
        )
    return specs


# the quick ones first: where the stage's time runs out, the experts' bfloat16 cases go unchecked
CASES: tuple[CaseSpec, ...] = (
    CaseSpec("smoke", (SMOKE.name,), smoke_case),
    *(spec for dtype in DECODER_DTYPES for spec in _decoder_cases(dtype)),
    *(spec for dtype in KQUANT_DTYPES for spec in _expert_cases(dtype)),
)


def run(limit: float, shapes: Shapes = QWEN3) -> dict:
    """The stage's JSON (see the module doc); at most `limit` seconds of checks started."""
    if not torch.cuda.is_available():
        return {"error": "no CUDA device"}
    from engine.gpu.launcher import CubinKernel

    deadline, loaded = time.monotonic() + limit, {}

    def load(name: str) -> CubinKernel:
        if name not in loaded:
            loaded[name] = CubinKernel.load(name)
        return loaded[name]

    copy, entries = copy_gbps(), {}
    for spec in CASES:
        if time.monotonic() > deadline:
            entries |= {spec.key(k): {"skipped": f"the stage's {limit:.0f} s ran out"} for k in spec.kernels}
        else:
            entries |= check(spec, shapes, load, copy)
    return {"summary": summary(entries), "copy_gbps": copy, **entries}


def check(spec: CaseSpec, shapes: Shapes, load: Callable, copy: float) -> dict:
    """`spec`'s case built on the GPU, judged, each launch that ran timed: its entries."""
    try:
        case = spec.build(shapes, "cuda", np.random.default_rng(0))
    except Exception as err:  # this check's result; the next one still runs
        return {
            spec.key(k): {"error": f"building its inputs: {type(err).__name__}: {err}"} for k in spec.kernels
        }
    entries = run_case(case, load, torch.cuda.synchronize)
    for launch in case.launches:
        if "error" not in entries[launch.kernel]:
            entries[launch.kernel] |= speed(load(launch.kernel), launch, copy)
    return {spec.key(kernel): entry for kernel, entry in entries.items()}


def speed(kernel, launch: Launch, copy: float) -> dict:
    """`launch`'s microseconds and, where it is bandwidth-bound, GB/s and their share of `copy`."""
    try:
        seconds = graph_seconds(kernel, launch)
    except Exception as err:
        return {"timing_error": f"{type(err).__name__}: {err}"}
    found = {"us": round(seconds * 1e6, 2)}
    if launch.read_bytes:
        gbps = launch.read_bytes / seconds / 1e9
        found |= {"gbps": round(gbps, 1), "of_copy": round(gbps / copy, 2)}
    return found


def graph_seconds(kernel, launch: Launch) -> float:
    """Seconds a launch: a CUDA graph of at least TIMED_LAUNCHES launches (its argument tuples in
    turn) replayed REPLAYS times between CUDA events, after one replay to warm up."""
    turns = launch.rotations or (launch.args,)
    count = len(turns) * -(-TIMED_LAUNCHES // len(turns))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(count):
            kernel(launch.grid, *turns[i % len(turns)])
    graph.replay()
    return _event_seconds(graph.replay, REPLAYS) / count


def _event_seconds(step: Callable[[], object], repeats: int) -> float:
    """Seconds a call of `step`, from CUDA events around `repeats` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def copy_gbps() -> float:
    """The card's device-to-device copy rate (bytes read and written), the kernels' yardstick."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    target = torch.empty_like(source)
    target.copy_(source)
    seconds = _event_seconds(lambda: target.copy_(source), 10)
    return round(2 * source.numel() / seconds / 1e9, 1)


def summary(entries: dict) -> dict:
    """How many entries are within tolerance; the keys of the others, by why."""
    by = {
        "outside_tolerance": [k for k, e in entries.items() if e.get("ok") is False],
        "errors": [k for k, e in entries.items() if "error" in e],
        "not_run": [k for k, e in entries.items() if "skipped" in e],
        "timing_errors": [k for k, e in entries.items() if "timing_error" in e],
    }
    ok = sum(e.get("ok") is True for e in entries.values())
    return {"within_tolerance": f"{ok} of {len(entries)}", **{k: v for k, v in by.items() if v}}
