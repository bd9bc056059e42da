"""Each launch of a kernel of this room as a range of torch's profiler: how a step's count sees them.

torch's profiler records the aten operators a step dispatches, not a Triton kernel nor a cubin
launched through the CUDA driver. `launch_range(name)` wraps one such launch in a range named
`engine.gpu::<name>` while the profiler records, and costs one check otherwise.
`engine.bench.op_counts` counts each range as one kernel launch and leaves out the operators
inside it: on the CPU, Triton's interpreter copies a launch's arguments with torch operators that
a GPU launch does not make.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

RANGE_PREFIX = "engine.gpu::"
_UNRECORDED = nullcontext()


def launch_range(name: str) -> AbstractContextManager:
    """A profiler range `engine.gpu::<name>` around one launch, while torch's profiler records."""
    if not torch.autograd._profiler_enabled():
        return _UNRECORDED
    return torch.profiler.record_function(RANGE_PREFIX + name)
