"""Kernels for tests/engine/gpu/test_aot.py's builds (imported only where triton is)."""

import triton
import triton.language as tl


@triton.jit
def hoarding_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """Keeps its whole block live across a reduction: with one warp, 8192 floats are 256 a thread,
    more than the 255 registers a thread can have, so ptxas spills."""
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets)
    tl.store(out_ptr + offsets, x * tl.sum(x * x) - tl.max(x))
