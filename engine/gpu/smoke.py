"""The smoke kernel: `out = x * alpha + y` over fp32 vectors, the smallest kernel that exercises
everything the ahead-of-time path does (pointers, an i32 and an fp32 scalar, a constexpr block).

Built with `enable_fp_fusion=False`, so on the device it rounds the product and the sum apart,
exactly as torch's `x * alpha + y` does; the GPU test compares them bit for bit. Only the build
imports this module (it needs triton); at run time the engine launches its cubin.
"""

import triton
import triton.language as tl


@triton.jit
def scaled_add_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x * alpha + y, mask=mask)
