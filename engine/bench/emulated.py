"""`python -m engine.bench --emulate-cuda`: a CPU run laid out and stepped as on CUDA, to count what
a GPU's decode step launches (`--count-ops`) without a GPU. Not for speed: every figure it gives
is labelled emulated.

What CUDA does and this does on the CPU: a GGUF's experts kept in the file's blocks (not repacked
for the CPU's kernels) in a device pool with a slot for every expert (a simulated link, `--sim-link
1000` unless given), filled at load and read through slot tables; experts computed in groups; the
fused kernels (`engine.gpu`: experts, decoder, the resident matrices' GEMV) in Triton's
interpreter, which must be on from the process's start (`TRITON_INTERPRET=1`); the one-token step
captured by the stand-in capture (`captured_step.eager_capture`: each replay runs the body again).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from engine.decode.captured_step import CapturedStep, eager_capture
from engine.decode.paths import StepPaths
from engine.decode.piecewise_step import PiecewiseStep
from engine.formats.gguf.experts import GgufFormat
from engine.resident import weights
from engine.resident.device_blocks import BlocksLinear

SIM_LINK_GBPS = 1000.0  # the simulated link's rate where none is given: the copies cost ~nothing


def interpreter_off() -> str | None:
    """Why the fused kernels cannot run in Triton's interpreter here, or None."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "--emulate-cuda runs the fused kernels in Triton's interpreter: start with TRITON_INTERPRET=1"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "--emulate-cuda needs triton (pip install -e '.[dev]')"
    return None


@contextmanager
def cuda_layout() -> Iterator[None]:
    """While a model loads: its GGUF experts in the file's blocks, its matrices in their blocks."""
    saved = GgufFormat.repacks_for_cpu, weights.BLOCKS_ON
    GgufFormat.repacks_for_cpu, weights.BLOCKS_ON = False, (*weights.BLOCKS_ON, "cpu")
    try:
        yield
    finally:
        GgufFormat.repacks_for_cpu, weights.BLOCKS_ON = saved


def step_as_on_cuda(model) -> None:
    """A loaded model's cache filled, its experts in groups, every fused kernel asked for, its
    one-token steps through the (stand-in) captured step, or its pieces where the budget misses."""
    model.cache.fill()
    model.control.grouped = True
    model.control.fused = True
    for module in model.hf_model.modules():
        if isinstance(module, BlocksLinear):
            module.gemv = "interpreted"
    model.captured = CapturedStep.of(model, capture=eager_capture)
    model.pieces = PiecewiseStep.of(model, model.captured, capture=eager_capture)  # with a budget
    model.paths = StepPaths.of(model.hf_model, model.lean, None, model.captured, model.pieces)
