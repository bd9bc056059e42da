"""Device code the fused MoE kernels of the FP8 and int4 families share: where the k-th routed
expert's row lies in the pool (looked up on the device), and SiLU · up as torch computes it.

Contract: the pool is the device cache's `uint8 [slots, expert_nbytes]`; the layer's slot table
`[E]` and the token's top-k ids `[K]` are read here, on the device, never on the host.
"""

import triton
import triton.language as tl


@triton.jit
def expert_row(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes):
    """Byte pointer to the pool row of the k-th routed expert: row table[ids[k]]. Rows start on
    16-byte boundaries (the pool's row size is a multiple of 16, ExpertLayout's of 64)."""
    slot = tl.load(table_ptr + tl.load(ids_ptr + k)).to(tl.int64)
    return tl.multiple_of(pool_ptr + slot * expert_nbytes, 16)


@triton.jit
def silu_times(gate, up):
    """silu(gate) · up as torch computes SiLU (`g / (1 + exp(−g))`), exp's argument capped at 88 (the
    interpreter raises numpy's overflow warning): a gate g < −88 gives g · 6e-39 here, −0 in torch."""
    return gate / (1.0 + tl.exp(tl.minimum(-gate, 88.0))) * up
