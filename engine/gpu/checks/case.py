"""A check of ahead-of-time kernels: the launches one case makes on inputs it built on a device, and
what each launch is judged by.

Contract: a `Case` is its `launches` (a registered kernel's name, its grid, its arguments in the
registry's order, as the engine's launches pass them) and `compare`, called once the launches have
run: `{name: (got, want)}`, the tensors the kernels wrote and torch's reference of them. Each
launch names the entries it is judged by; `run_case` runs the launches through any loader (the
cubins on a GPU, Triton's interpreter in the CPU tests) and gives each kernel its entry: every
output's largest error relative to the reference's largest value, and whether each is within its
`tolerance`. A launch that raises is that kernel's error; the others still run. `Shapes` are the
sizes a case is built at: `QWEN3` on a GPU, smaller ones in the tests.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

FP32_RTOL = 1e-5  # float32 outputs: the kernels' sums in their order and the GPU's exp, rsqrt, TF32x3
BF16_RTOL = 2.0**-7  # bfloat16 outputs: a step of its 8 bits at the largest value, a few below it
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the registry's activation dtypes


@dataclass(frozen=True)
class Shapes:
    """The sizes a case is built at (defaults: a Qwen3-30B-A3B layer's)."""

    hidden: int = 2048
    inter: int = 768  # an expert's intermediate size
    experts: int = 16  # experts in the pool with checked values (the kernels read top_k of them)
    top_k: int = 8
    router_experts: int = 128
    tokens: int = 4  # the router's rows
    heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    capacity: int = 4096  # the KV cache's positions
    gemv_rows: int = 4096  # a quantized GEMV's outputs (q_proj's)
    group_size: int = 128  # int4 groups
    # bytes a timed bandwidth-bound launch reads in turn from other memory (other experts, matrices,
    # layers' caches), many times the L2 cache, so that its reads come from the card's memory
    timing_bytes: int = 256 << 20


QWEN3 = Shapes()


@dataclass(frozen=True)
class Launch:
    """One launch of a registered kernel."""

    kernel: str  # the registry's name: CubinKernel.load's key
    grid: tuple[int, ...]
    args: tuple  # the kernel's own parameters, the registry signature's order
    judged_by: tuple[str, ...]  # the entries of the case's `compare` that check its outputs
    read_bytes: int = 0  # what a launch reads of its bulk inputs; 0: not bandwidth-bound (no GB/s)
    rotations: tuple[tuple, ...] = ()  # argument tuples reading other memory, timed in turn


@dataclass(frozen=True)
class Case:
    """The launches of one check, in order, and their outputs against the reference."""

    launches: tuple[Launch, ...]
    compare: Callable[[], dict[str, tuple[torch.Tensor, torch.Tensor]]]
    exact: frozenset[str] = frozenset()  # entries that must match bit for bit


def merged(*cases: Case) -> Case:
    """One case of several: their launches in order, their comparisons together."""

    def compare() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {name: pair for case in cases for name, pair in case.compare().items()}

    launches = tuple(launch for case in cases for launch in case.launches)
    return Case(launches, compare, frozenset().union(*(case.exact for case in cases)))


def tolerance(got: torch.Tensor, exact: bool = False) -> float:
    """The largest error allowed relative to the reference's largest value, by the output's dtype."""
    if exact:
        return 0.0
    return BF16_RTOL if got.dtype in (torch.bfloat16, torch.float16) else FP32_RTOL


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got − want| over the largest finite |want|, in float64; values equal on both sides
    (infinities too) count 0; a NaN or an infinity on one side only makes it NaN or infinite, never
    within a tolerance."""
    got, want = got.double(), want.to(got.device).double()
    if got.shape != want.shape:
        raise ValueError(f"the output is {tuple(got.shape)}, the reference {tuple(want.shape)}")
    error = torch.where(got == want, 0.0, (got - want).abs())
    finite = want[want.isfinite()].abs()
    scale = finite.max().clamp_min(1e-30) if finite.numel() else torch.tensor(1.0)
    return float(error.max() / scale)


def run_case(case: Case, load: Callable[[str], Callable], finish: Callable[[], None] = lambda: None) -> dict:
    """Each launch of `case` run once, `load(kernel)(grid, *args)`, then `finish()` (a GPU's
    synchronize: an error is its launch's), then judged: `{kernel: entry}`."""
    entries: dict[str, dict] = {}
    for launch in case.launches:
        try:
            load(launch.kernel)(launch.grid, *launch.args)
            finish()
        except Exception as err:  # this kernel's result; the next launch still runs
            entries[launch.kernel] = {"error": f"{type(err).__name__}: {err}"}
    try:
        pairs = case.compare()
    except Exception as err:
        failed = {"error": f"the reference: {type(err).__name__}: {err}"}
        return {launch.kernel: entries.get(launch.kernel, failed) for launch in case.launches}
    for launch in case.launches:
        if launch.kernel not in entries:
            entries[launch.kernel] = judge(launch, pairs, case.exact)
    return entries


def judge(launch: Launch, pairs: dict, exact: frozenset[str] = frozenset()) -> dict:
    """`launch`'s entry: each of its outputs' relative error, and whether all are within tolerance."""
    errors, ok = {}, True
    for name in launch.judged_by:
        got, want = pairs[name]
        errors[name] = relative(got, want)
        ok &= errors[name] <= tolerance(got, name in exact)  # NaN is never within
    shown = {name: float(f"{e:.3g}") if math.isfinite(e) else str(e) for name, e in errors.items()}
    return {"ok": ok, "rel_error": shown}  # NaN and inf as strings: the report stays strict JSON
