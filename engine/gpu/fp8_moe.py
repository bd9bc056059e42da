"""One token's routed experts straight from FP8 e4m3 values and their block scales: fused dequantize
+ GEMV.

Contract: as `engine.gpu.kquant_moe`'s — the pool is the device cache's `uint8 [slots,
expert_nbytes]`, the layer's slot table `[E]` and the token's top-k ids `[K]` are read on the
device, never on the host — for FP8 fields (`engine.formats.fields.Fp8Blocks`): the e4m3 values
`(out, in)`, row after row, at one byte offset of an expert's row, their float32 `scale_inv`
`[ceil(out / block_rows), ceil(in / block_cols)]` at another (`engine.gpu.projections.Fp8Projection`).
The block is an argument: 128 × 128 blocks (partial ones at the edges too), a row's or the whole
matrix's, as long as each 32 columns lie under one scale.

- `moe_gate_up`: `act [K, I] = silu(gate) · up` of each of the K experts, gate the first I rows of
  its `gate_up_proj` and up the next I; one program a block of `BLOCK_N` rows of one expert.
- `moe_down`: `out [H] = Σ_k w_k · down_k @ act_k`, the K experts summed in order inside one
  program (no atomics: the same sums every run); one program a block of rows.
- `quantized_gemv`: `W @ x` for one FP8 matrix (`engine.formats.fp8.Fp8Weight`).

Each weight is `engine.formats.fp8.dequantize`'s: the e4m3 value's float32 (exact, decoded with
integer operations — sm_80 has no FP8 conversion — subnormals and NaN included) times its block's
scale, one float32 multiply; the dot products accumulate in float32, the order differs from a BLAS
matmul's. Launched as `engine.gpu.kquant_moe.LAUNCH` says (no FMA contraction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.formats.fp8 import Fp8Weight, scale_shape
from engine.gpu.kquant_moe import LAUNCH, _vector, routed_down, routed_gate_up
from engine.gpu.launch_ranges import launch_range
from engine.gpu.projections import LANES, Fp8Projection
from engine.gpu.registry import FP8_BLOCK_N
from engine.gpu.routed import expert_row, silu_times

BLOCK_N = FP8_BLOCK_N  # output rows a program


# -- device code: a chunk of 256 columns of BLOCK_N rows at a time, as 8 sub-blocks of 32 ------------


@triton.jit
def _e4m3(byte):
    """The float32 of e4m3fn bytes (any shape), as torch converts float8_e4m3fn: sign, 4 exponent
    bits (bias 7), 3 mantissa bits; exponent 0 is subnormal (m · 2^-9); S.1111.111 is NaN (no
    infinities)."""
    bits = byte.to(tl.int32)
    magnitude = bits & 0x7F
    # a normal value's bits moved into float32's fields, its exponent rebiased by 127 − 7
    normal = ((magnitude << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    subnormal = (bits & 7).to(tl.float32) * 0.001953125
    value = tl.where(magnitude < 8, subnormal, normal)
    value = tl.where(magnitude == 0x7F, float("nan"), value)
    return tl.where(bits >= 128, -value, value)


@triton.jit
def _row_dots(values, scales, rows, x_ptr, n_cols, block_rows, block_cols, BLOCK_N: tl.constexpr):
    """`rows [BLOCK_N]` (int64) of the e4m3 matrix at `values` (`n_cols` bytes a row), each value
    times its scale in `scales` (float32 `[ceil(rows / block_rows), ceil(n_cols / block_cols)]`),
    dotted with x[:n_cols]: float32, accumulated a chunk of 256 columns at a time in column order."""
    row = rows[:, None, None]  # [BN, 1, 1]
    sub = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    scale_row = scales + (row // block_rows) * tl.cdiv(n_cols, block_cols)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, 256):
        first = start + 32 * sub  # each sub-block's first column: its 32 lie under one scale
        cols = first + lane
        valid = cols < n_cols
        code = tl.load(values + row * n_cols + cols, mask=valid, other=0)
        scale = tl.load(scale_row + first // block_cols, mask=first < n_cols, other=0.0)  # [BN, 8, 1]
        w = _e4m3(code) * scale
        x = tl.load(x_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    return acc


@triton.jit
def moe_gate_up_kernel(
    x_ptr, pool_ptr, table_ptr, ids_ptr, act_ptr,
    expert_nbytes, field_offset, scale_offset, block_rows, block_cols, inter, hidden,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(inter, BLOCK_N), K)`: act[k, rows] = silu(gate) · up of expert ids[k]."""
    k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, inter - 1).to(tl.int64)  # the last block's spare rows read the last row
    expert = expert_row(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes)
    values, scales = expert + field_offset, (expert + scale_offset).to(tl.pointer_type(tl.float32))
    gate = _row_dots(values, scales, safe, x_ptr, hidden, block_rows, block_cols, BLOCK_N)
    up = _row_dots(values, scales, safe + inter, x_ptr, hidden, block_rows, block_cols, BLOCK_N)
    tl.store(act_ptr + k * inter + rows, silu_times(gate, up), mask=rows < inter)


@triton.jit
def moe_down_kernel(
    act_ptr, pool_ptr, table_ptr, ids_ptr, weights_ptr, out_ptr,
    expert_nbytes, field_offset, scale_offset, block_rows, block_cols, hidden, inter, top_k,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(hidden, BLOCK_N),)`: out[rows] = Σ_k weights[k] · down(ids[k])[rows] @ act[k]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, hidden - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        expert = expert_row(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes)
        values, scales = expert + field_offset, (expert + scale_offset).to(tl.pointer_type(tl.float32))
        y = _row_dots(values, scales, safe, act_ptr + k * inter, inter, block_rows, block_cols, BLOCK_N)
        acc += tl.load(weights_ptr + k).to(tl.float32) * y
    tl.store(out_ptr + rows, acc, mask=rows < hidden)


@triton.jit
def quantized_gemv_kernel(
    x_ptr, weights_ptr, scales_ptr, out_ptr, out_features, in_features, block_rows, block_cols,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(out_features, BLOCK_N),)`: out[rows] = W[rows] @ x."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, out_features - 1).to(tl.int64)
    y = _row_dots(weights_ptr, scales_ptr, safe, x_ptr, in_features, block_rows, block_cols, BLOCK_N)
    tl.store(out_ptr + rows, y, mask=rows < out_features)


# -- host side: checks and launches through Triton's JIT -------------------------------------------


def moe_gate_up(
    x: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    projection: Fp8Projection,
    block_n: int = BLOCK_N,
    act: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act [K, I]` float32: silu(gate) · up of each expert `ids [K]` (its pool row `table[ids[k]]`),
    from its FP8 `gate_up_proj` (`projection`: 2I rows of H columns) and `x [H]` (or `[1, H]`);
    written into `act` where given (`K · I` float32 values). Reads nothing on the host."""
    return routed_gate_up(moe_gate_up_kernel, "fp8", {}, x, pool, table, ids, projection, block_n, act)


def moe_down(
    act: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    projection: Fp8Projection,
    block_n: int = BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out [H]` float32 = Σ_k weights[k] · down(ids[k]) @ act[k], summed in k's order, from each
    expert's FP8 `down_proj` (`projection`: H rows of I columns) and `act [K, I]` (`moe_gate_up`'s);
    written into `out` where given (H float values, the float32 sums rounded once to its dtype).
    Reads nothing on the host."""
    return routed_down(moe_down_kernel, "fp8", {}, act, pool, table, ids, weights, projection, block_n, out)


def quantized_gemv(x: torch.Tensor, weight: Fp8Weight, block_n: int = BLOCK_N) -> torch.Tensor:
    """`W @ x` float32 `[out]` for an FP8 weight (e4m3 `(out, in)` and its scales) and `x [in]`."""
    (rows, columns), (block_rows, block_cols) = weight.data.shape, weight.block
    if block_cols % LANES and block_cols < columns:
        raise ValueError(f"scales {block_cols} columns wide: the kernel reads {LANES} columns under one")
    scales = weight.scale_inv
    if scales.dtype != torch.float32 or tuple(scales.shape) != scale_shape((rows, columns), weight.block):
        raise ValueError(f"the scales are not float32 {scale_shape((rows, columns), weight.block)}")
    x = _vector(x, columns, "x")
    values = weight.data.contiguous().view(torch.uint8)
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    with launch_range("quantized_gemv_fp8"):
        quantized_gemv_kernel[(triton.cdiv(rows, block_n),)](
            x, values, scales.contiguous(), out, rows, columns, block_rows, block_cols,
            BLOCK_N=block_n, **LAUNCH,
        )  # fmt: skip
    return out
