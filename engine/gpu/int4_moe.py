"""One token's routed experts straight from GPTQ, AWQ and compressed-tensors int4 words: fused
dequantize + GEMV.

Contract: as `engine.gpu.kquant_moe`'s — the pool is the device cache's `uint8 [slots,
expert_nbytes]`, the layer's slot table `[E]` and the token's top-k ids `[K]` are read on the
device, never on the host — for int4 fields (`engine.formats.fields.Int4Words`): the checkpoint's
int32 words, zeros, float16/bfloat16 scales and, for act-order, g_idx rows, each at its own byte
offset of an expert's row (`engine.gpu.projections.Int4Projection`), packed as
`engine.formats.int4` describes each format (`FORMAT`, its index in `FORMATS`):

    GPTQ, GPTQ_V2  qweight [in/8, out] (inputs packed), qzeros [groups, out/8], scales [groups, out]
    AWQ            qweight [in, out/8] (outputs packed in AWQ's order), qzeros and scales as GPTQ's
    CT, CT_SYM     qweight [out, in/8] (inputs packed), qzeros [out/8, groups] (CT_SYM: none, 8),
                   scales [out, groups]

- `moe_gate_up`: `act [K, I] = silu(gate) · up` of each of the K experts, gate the first I rows of
  its `gate_up_proj` and up the next I; one program a block of `BLOCK_N` rows of one expert.
- `moe_down`: `out [H] = Σ_k w_k · down_k @ act_k`, the K experts summed in order inside one
  program (no atomics); one program a block of rows.
- `quantized_gemv`: `W @ x` for one int4 matrix (`engine.formats.int4.Int4Weight`).

Each weight is `engine.formats.int4.dequantize`'s `(q − z) · s`: code minus zero in int32 (GPTQ
v1's stored zero plus one), converted to float32, times the scale's float32; the dot products
accumulate in float32, their order differs from a BLAS matmul's. Without act-order a group's
inputs are consecutive and each 32 of them share a scale (`ACT_ORDER` False); with it each input
looks its group up in the g_idx row of its rows (`part_rows` rows a g_idx row: gate and up keep
one each). Launched as `engine.gpu.kquant_moe.LAUNCH` says (no FMA contraction).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.formats.int4 import AWQ, CT, CT_SYM, FORMATS, GPTQ, Int4Weight, groups
from engine.gpu.kquant_moe import LAUNCH, _vector, routed_down, routed_gate_up
from engine.gpu.launch_ranges import launch_range
from engine.gpu.projections import LANES, Int4Projection
from engine.gpu.registry import INT4_BLOCK_N, int4_variant
from engine.gpu.routed import expert_row, silu_times

BLOCK_N = INT4_BLOCK_N  # output rows a program
F_GPTQ: tl.constexpr = tl.constexpr(FORMATS.index(GPTQ))
F_AWQ: tl.constexpr = tl.constexpr(FORMATS.index(AWQ))
F_CT: tl.constexpr = tl.constexpr(FORMATS.index(CT))
F_CT_SYM: tl.constexpr = tl.constexpr(FORMATS.index(CT_SYM))


# -- device code: a chunk of 256 inputs of BLOCK_N rows at a time, as 8 sub-blocks of 32 ------------


@triton.jit
def _nibble(words, index):
    return (words >> (4 * index)) & 15


@triton.jit
def _awq_nibble(column):
    """The nibble of a word holding column `column` of its 8 in AWQ's order (int4.AWQ_NIBBLE)."""
    return column // 2 + 4 * (column % 2)


@triton.jit
def _codes(qweight, row, cols, valid, n_rows, n_cols, FORMAT: tl.constexpr):
    """The codes (0..15) of rows `row [BN, 1, 1]` at inputs `cols [1, 8, 32]`."""
    if FORMAT == F_AWQ:
        words = tl.load(qweight + cols * (n_rows // 8) + row // 8, mask=valid, other=0)
        return _nibble(words, _awq_nibble(row % 8))
    elif FORMAT >= F_CT:
        words = tl.load(qweight + row * (n_cols // 8) + cols // 8, mask=valid, other=0)
        return _nibble(words, cols % 8)
    else:
        words = tl.load(qweight + (cols // 8) * n_rows + row, mask=valid, other=0)
        return _nibble(words, cols % 8)


@triton.jit
def _zeros(qzeros, row, group, at, n_rows, n_groups, FORMAT: tl.constexpr):
    """The zero points of rows `row` in groups `group` (loaded where `at`), as int4.zeros gives them."""
    if FORMAT == F_CT_SYM:
        return tl.full((1, 1, 1), 8, tl.int32)  # the signed codes' zero, stored as none
    elif FORMAT == F_CT:
        words = tl.load(qzeros + (row // 8) * n_groups + group, mask=at, other=0)
        return _nibble(words, row % 8)
    elif FORMAT == F_AWQ:
        words = tl.load(qzeros + group * (n_rows // 8) + row // 8, mask=at, other=0)
        return _nibble(words, _awq_nibble(row % 8))
    else:
        words = tl.load(qzeros + group * (n_rows // 8) + row // 8, mask=at, other=0)
        return _nibble(words, row % 8) + (1 if FORMAT == F_GPTQ else 0)  # v1 stores the zero − 1


@triton.jit
def _scales(scales, row, group, at, n_rows, n_groups, scales_bf16, FORMAT: tl.constexpr):
    """The float32 scales (`scales`: their 16 bits) of rows `row` in groups `group`."""
    index = row * n_groups + group if FORMAT >= F_CT else group * n_rows + row
    bits = tl.load(scales + index, mask=at, other=0).to(tl.uint32)
    bf16 = (bits << 16).to(tl.float32, bitcast=True)
    f16 = bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    return tl.where(scales_bf16 != 0, bf16, f16)


@triton.jit
def _row_dots(
    qweight, qzeros, scales, g_idx, rows, x_ptr, n_rows, n_cols, group_size, scales_bf16,
    FORMAT: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`rows [BLOCK_N]` of the `(n_rows, n_cols)` int4 weight (int32 words and zeros, the scales'
    16 bits; `g_idx`: the g_idx row of these rows, int32) dotted with x[:n_cols]: float32, a chunk
    of 256 inputs at a time."""
    row = rows[:, None, None]  # [BN, 1, 1]
    sub = tl.arange(0, 8)[None, :, None]  # [1, 8, 1]
    lane = tl.arange(0, 32)[None, None, :]  # [1, 1, 32]
    n_groups = n_cols // group_size
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, n_cols, 256):
        first = start + 32 * sub  # each sub-block's first input
        cols = first + lane
        valid = cols < n_cols
        if ACT_ORDER:  # each input's own group: [1, 8, 32]
            at = valid
            group = tl.load(g_idx + cols, mask=at, other=0)
        else:  # a sub-block's 32 inputs lie in one group: [1, 8, 1]
            at = first < n_cols
            group = first // group_size
        q = _codes(qweight, row, cols, valid, n_rows, n_cols, FORMAT)
        z = _zeros(qzeros, row, group, at, n_rows, n_groups, FORMAT)
        s = _scales(scales, row, group, at, n_rows, n_groups, scales_bf16, FORMAT)
        w = (q - z).to(tl.float32) * s
        x = tl.load(x_ptr + cols, mask=valid, other=0.0).to(tl.float32)
        acc += tl.sum(tl.sum(w * x, axis=2), axis=1)
    return acc


@triton.jit
def _expert_dots(
    expert, rows, part, x_ptr, n_rows, n_cols, field_offset, qzeros_offset, scales_offset,
    g_idx_offset, group_size, scales_bf16,
    FORMAT: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`_row_dots` of the int4 field at the offsets of pool row `expert`; `rows` all lie in one of
    its stacked matrices, whose g_idx row is `part`."""
    qweight = (expert + field_offset).to(tl.pointer_type(tl.int32))
    qzeros = (expert + qzeros_offset).to(tl.pointer_type(tl.int32))
    scales = (expert + scales_offset).to(tl.pointer_type(tl.uint16))
    g_idx = (expert + g_idx_offset).to(tl.pointer_type(tl.int32)) + part * n_cols
    return _row_dots(
        qweight, qzeros, scales, g_idx, rows, x_ptr, n_rows, n_cols, group_size, scales_bf16,
        FORMAT, ACT_ORDER, BLOCK_N,
    )  # fmt: skip


@triton.jit
def moe_gate_up_kernel(
    x_ptr, pool_ptr, table_ptr, ids_ptr, act_ptr,
    expert_nbytes, field_offset, qzeros_offset, scales_offset, g_idx_offset, part_rows, group_size,
    scales_bf16, inter, hidden,
    FORMAT: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(inter, BLOCK_N), K)`: act[k, rows] = silu(gate) · up of expert ids[k]. Gate's
    g_idx row is the first, up's its own where gate and up keep one each (`part_rows` = I)."""
    k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, inter - 1)  # the last block's spare rows read the last row
    expert = expert_row(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes)
    fields = (field_offset, qzeros_offset, scales_offset, g_idx_offset, group_size, scales_bf16)
    gate = _expert_dots(expert, safe, 0, x_ptr, 2 * inter, hidden, *fields, FORMAT, ACT_ORDER, BLOCK_N)
    up_rows, up_part = safe + inter, inter // part_rows
    up = _expert_dots(expert, up_rows, up_part, x_ptr, 2 * inter, hidden, *fields, FORMAT, ACT_ORDER, BLOCK_N)
    tl.store(act_ptr + k * inter + rows, silu_times(gate, up), mask=rows < inter)


@triton.jit
def moe_down_kernel(
    act_ptr, pool_ptr, table_ptr, ids_ptr, weights_ptr, out_ptr,
    expert_nbytes, field_offset, qzeros_offset, scales_offset, g_idx_offset, part_rows, group_size,
    scales_bf16, hidden, inter, top_k,
    FORMAT: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(hidden, BLOCK_N),)`: out[rows] = Σ_k weights[k] · down(ids[k])[rows] @ act[k].
    down_proj is one matrix, with one g_idx row (`part_rows` = H)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, hidden - 1)
    fields = (field_offset, qzeros_offset, scales_offset, g_idx_offset, group_size, scales_bf16)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        expert = expert_row(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes)
        x_ptr = act_ptr + k * inter
        y = _expert_dots(expert, safe, 0, x_ptr, hidden, inter, *fields, FORMAT, ACT_ORDER, BLOCK_N)
        acc += tl.load(weights_ptr + k).to(tl.float32) * y
    tl.store(out_ptr + rows, acc, mask=rows < hidden)


@triton.jit
def quantized_gemv_kernel(
    x_ptr, qweight_ptr, qzeros_ptr, scales_ptr, g_idx_ptr, out_ptr,
    out_features, in_features, group_size, scales_bf16,
    FORMAT: tl.constexpr, ACT_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(out_features, BLOCK_N),)`: out[rows] = W[rows] @ x (one matrix: one g_idx row)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, out_features - 1)
    y = _row_dots(
        qweight_ptr, qzeros_ptr, scales_ptr.to(tl.pointer_type(tl.uint16)), g_idx_ptr, safe, x_ptr,
        out_features, in_features, group_size, scales_bf16, FORMAT, ACT_ORDER, BLOCK_N,
    )  # fmt: skip
    tl.store(out_ptr + rows, y, mask=rows < out_features)


# -- host side: checks and launches through Triton's JIT -------------------------------------------


def moe_gate_up(
    x: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    projection: Int4Projection,
    block_n: int = BLOCK_N,
    act: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act [K, I]` float32: silu(gate) · up of each expert `ids [K]` (its pool row `table[ids[k]]`),
    from its int4 `gate_up_proj` (`projection`: 2I rows of H inputs) and `x [H]` (or `[1, H]`);
    written into `act` where given (`K · I` float32 values). Reads nothing on the host."""
    return routed_gate_up(
        moe_gate_up_kernel,
        projection.label,
        projection.constexprs,
        x,
        pool,
        table,
        ids,
        projection,
        block_n,
        act,
    )


def moe_down(
    act: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    projection: Int4Projection,
    block_n: int = BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out [H]` float32 = Σ_k weights[k] · down(ids[k]) @ act[k], summed in k's order, from each
    expert's int4 `down_proj` (`projection`: H rows of I inputs) and `act [K, I]` (`moe_gate_up`'s);
    written into `out` where given (H float values, the float32 sums rounded once to its dtype).
    Reads nothing on the host."""
    return routed_down(
        moe_down_kernel,
        projection.label,
        projection.constexprs,
        act,
        pool,
        table,
        ids,
        weights,
        projection,
        block_n,
        out,
    )


def quantized_gemv(x: torch.Tensor, weight: Int4Weight, block_n: int = BLOCK_N) -> torch.Tensor:
    """`W @ x` float32 `[out]` for an int4 weight (its words, zeros, scales, g_idx) and `x [in]`."""
    (rows, columns), act_order = weight.shape, weight.g_idx is not None
    group_size = columns // groups(weight)
    if weight.scales.dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"the kernel reads float16 and bfloat16 scales, not {weight.scales.dtype}")
    if not act_order and group_size % LANES and group_size < columns:
        raise ValueError(f"groups of {group_size} inputs: the kernel reads {LANES} inputs under one scale")
    x = _vector(x, columns, "x")
    qweight, qzeros, scales = (t.contiguous() for t in (weight.qweight, weight.qzeros, weight.scales))
    if act_order and weight.g_idx.shape[0] != 1:
        raise ValueError(f"one matrix has one g_idx row; got {weight.g_idx.shape[0]}")
    g_idx = weight.g_idx.contiguous() if act_order else qweight  # not read without act-order
    bf16 = int(scales.dtype == torch.bfloat16)
    constexprs = {"FORMAT": FORMATS.index(weight.format), "ACT_ORDER": act_order}
    out = torch.empty(rows, dtype=torch.float32, device=x.device)
    with launch_range(f"quantized_gemv_{int4_variant(weight.format, act_order)}"):
        quantized_gemv_kernel[(triton.cdiv(rows, block_n),)](
            x, qweight, qzeros, scales, g_idx, out, rows, columns, group_size, bf16,
            **constexprs, BLOCK_N=block_n, **LAUNCH,
        )  # fmt: skip
    return out
