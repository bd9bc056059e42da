"""One token's routed experts straight from GGUF blocks: fused dequantize + GEMV, kernels and launches.

Contract: the pool is the device cache's `uint8 [slots, expert_nbytes]`, each expert one packed row
(`engine.formats.layout.ExpertLayout`); a ggml field of it is `[out rows, bytes per row]` of blocks
at a byte offset in the row, a row of blocks holding one output row's weights in the file's column
order, in one of `engine.gpu.registry.KQUANT_TYPES` (Q4_K, Q5_K, Q6_K, Q8_0, IQ4_XS, IQ4_NL, MXFP4).
The layer's slot table `[E]` and the token's top-k ids `[K]` stay on the device: the host never
reads which experts run, so the launches are the same for every route (a CUDA graph).

- `moe_gate_up`: `act [K, I] = silu(gate) · up` of each of the K experts, gate the first I rows of
  its `gate_up_proj` and up the next I (transformers' `_default_apply_gate`, the layout GGUF
  experts are packed in); one program a block of `BLOCK_N` rows of one expert.
- `moe_down`: `out [H] = Σ_k w_k · down_k @ act_k`, the K experts summed in order inside one
  program (no atomics: the same sums every run); one program a block of rows.
- `moe_gate_up_clamped` / `moe_down_biased`: the same with gpt-oss's experts' biases and gate (its
  clamped SwiGLU on interleaved gate and up rows), as `engine.moe.fused_experts` launches them.
- `quantized_gemv`: `W @ x` for one quantized matrix (attention, lm_head), the same inner code.

Each weight is dequantized as `engine.formats.gguf.blocks.dequantize` builds it — the same float32
operations in the same order, per type in `engine.gpu.ggml_dots` — and the dot products accumulate
in float32 (their order differs from a BLAS matmul's). On a GPU they are compiled with
`enable_fp_fusion=False` (`LAUNCH`): contracting `q · s − m` to an FMA would round once instead of
twice. The kernels take pointers, ints and constexprs only, so they can be built ahead of time;
the wrappers here launch them through Triton's JIT (and its interpreter, `TRITON_INTERPRET=1`, on
CPU tensors). The activation is SiLU's, as `torch.nn.functional.silu` computes it
(`g / (1 + exp(−g))`): families with another activation do not take this path.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType

from engine.errors import UnsupportedQuantizationError
from engine.formats.gguf.blocks import ggml_type_traits, row_bytes
from engine.gpu.ggml_dots import _row_bytes, _row_dots
from engine.gpu.launch_ranges import launch_range
from engine.gpu.registry import FIELD_ALIGN, KQUANT_BLOCK_N, KQUANT_TYPES

BLOCK_N = KQUANT_BLOCK_N  # output rows a program
# how the wrappers launch the kernels, as the ahead-of-time build compiles them: no FMA contraction,
# so that each weight is the reference's float32 value
LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)

SUPPORTED = KQUANT_TYPES


# -- device code: the kernels, around engine.gpu.ggml_dots's rows of blocks dotted with x ----------


@triton.jit
def _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, field_offset):
    """Byte pointer to the field of the k-th routed expert in the pool: table[ids[k]]'s row. Rows and
    fields start on 16-byte boundaries (ExpertLayout aligns them to 64): K-quants' bytes load as vectors."""
    slot = tl.load(table_ptr + tl.load(ids_ptr + k)).to(tl.int64)
    return tl.multiple_of(pool_ptr + slot * expert_nbytes + field_offset, 16)


@triton.jit
def moe_gate_up_kernel(
    x_ptr, pool_ptr, table_ptr, ids_ptr, act_ptr,
    expert_nbytes, field_offset, inter, hidden,
    GGML_TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(inter, BLOCK_N), K)`: act[k, rows] = silu(gate) · up of expert ids[k]."""
    k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, inter - 1).to(tl.int64)  # the last block's spare rows read the last row
    field = _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, field_offset)
    row_bytes = _row_bytes(hidden, GGML_TYPE)
    gate = _row_dots(field + safe * row_bytes, x_ptr, hidden, GGML_TYPE, BLOCK_N)
    up = _row_dots(field + (safe + inter) * row_bytes, x_ptr, hidden, GGML_TYPE, BLOCK_N)
    # SiLU as torch computes it, exp's argument capped at 88 (the interpreter raises numpy's overflow
    # warning): a gate g < −88 gives g · 6e-39 here, −0 in torch
    act = gate / (1.0 + tl.exp(tl.minimum(-gate, 88.0))) * up
    tl.store(act_ptr + k * inter + rows, act, mask=rows < inter)


@triton.jit
def moe_down_kernel(
    act_ptr, pool_ptr, table_ptr, ids_ptr, weights_ptr, out_ptr,
    expert_nbytes, field_offset, hidden, inter, top_k,
    GGML_TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(hidden, BLOCK_N),)`: out[rows] = Σ_k weights[k] · down(ids[k])[rows] @ act[k]."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, hidden - 1).to(tl.int64)
    row_bytes = _row_bytes(inter, GGML_TYPE)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        field = _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, field_offset)
        y = _row_dots(field + safe * row_bytes, act_ptr + k * inter, inter, GGML_TYPE, BLOCK_N)
        acc += tl.load(weights_ptr + k).to(tl.float32) * y
    tl.store(out_ptr + rows, acc, mask=rows < hidden)


@triton.jit
def quantized_gemv_kernel(
    x_ptr, blocks_ptr, out_ptr, out_features, in_features,
    GGML_TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(out_features, BLOCK_N),)`: out[rows] = W[rows] @ x."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, out_features - 1).to(tl.int64)
    row_bytes = _row_bytes(in_features, GGML_TYPE)
    y = _row_dots(blocks_ptr + safe * row_bytes, x_ptr, in_features, GGML_TYPE, BLOCK_N)
    tl.store(out_ptr + rows, y, mask=rows < out_features)


@triton.jit
def moe_gate_up_clamped_kernel(
    x_ptr, pool_ptr, table_ptr, ids_ptr, act_ptr,
    expert_nbytes, field_offset, bias_offset, inter, hidden, alpha, limit,
    GGML_TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Grid `(cdiv(inter, BLOCK_N), K)`: gpt-oss's gate of expert ids[k] — gate and up the
    interleaved rows 2i and 2i + 1 of `gate_up_proj`, each plus its bias (in x's dtype, at
    `bias_offset` in the expert's row), gate capped at `limit`, up clamped to ±`limit`, act[k, i] =
    (up + 1) · gate · sigmoid(alpha · gate)."""
    k = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, inter - 1).to(tl.int64)
    field = _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, field_offset)
    bias = _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, bias_offset)
    bias = bias.to(tl.pointer_type(x_ptr.dtype.element_ty))
    row_bytes = _row_bytes(hidden, GGML_TYPE)
    gate = _row_dots(field + 2 * safe * row_bytes, x_ptr, hidden, GGML_TYPE, BLOCK_N)
    up = _row_dots(field + (2 * safe + 1) * row_bytes, x_ptr, hidden, GGML_TYPE, BLOCK_N)
    gate = tl.minimum(gate + tl.load(bias + 2 * safe).to(tl.float32), limit)
    up = tl.minimum(tl.maximum(up + tl.load(bias + 2 * safe + 1).to(tl.float32), -limit), limit)
    glu = gate / (1.0 + tl.exp(tl.minimum(-gate * alpha, 88.0)))  # the sigmoid as torch's (see SiLU)
    tl.store(act_ptr + k * inter + rows, (up + 1.0) * glu, mask=rows < inter)


@triton.jit
def moe_down_biased_kernel(
    act_ptr, pool_ptr, table_ptr, ids_ptr, weights_ptr, out_ptr,
    expert_nbytes, field_offset, bias_offset, hidden, inter, top_k,
    GGML_TYPE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`moe_down_kernel` with each expert's bias (in out's dtype, at `bias_offset` in its row) added
    before its routing weight: out[rows] = Σ_k weights[k] · (down(ids[k])[rows] @ act[k] + bias)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    safe = tl.minimum(rows, hidden - 1).to(tl.int64)
    row_bytes = _row_bytes(inter, GGML_TYPE)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k in range(0, top_k):
        field = _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, field_offset)
        bias = _field_of(pool_ptr, table_ptr, ids_ptr, k, expert_nbytes, bias_offset)
        bias = bias.to(tl.pointer_type(out_ptr.dtype.element_ty))
        y = _row_dots(field + safe * row_bytes, act_ptr + k * inter, inter, GGML_TYPE, BLOCK_N)
        acc += tl.load(weights_ptr + k).to(tl.float32) * (y + tl.load(bias + safe).to(tl.float32))
    tl.store(out_ptr + rows, acc, mask=rows < hidden)


# -- host side: checks and launches through Triton's JIT -------------------------------------------


def _checked_type(ggml_type: GGMLQuantizationType | int, columns: int) -> int:
    """`ggml_type` as an int, when a kernel here reads it and `columns` fill whole blocks."""
    traits = ggml_type_traits(ggml_type)  # UnsupportedQuantizationError for no ggml type at all
    if traits.ggml_type not in SUPPORTED:
        raise UnsupportedQuantizationError(
            f"The fused GPU kernels read {_type_names()} blocks, not {traits.name}."
        )
    row_bytes(traits.ggml_type, columns)  # ValueError unless whole blocks
    return int(traits.ggml_type)


def _type_names() -> str:
    """The types the kernels read, as a message lists them: "Q4_K, …, IQ4_NL and MXFP4"."""
    names = [GGMLQuantizationType(t).name for t in SUPPORTED]
    return f"{', '.join(names[:-1])} and {names[-1]}"


def _check_field(pool: torch.Tensor, field_offset: int, nbytes: int) -> None:
    if pool.dtype != torch.uint8 or pool.dim() != 2 or not pool.is_contiguous():
        raise ValueError(f"the pool is contiguous uint8 [slots, expert bytes]; got {pool.dtype} {pool.shape}")
    if pool.shape[1] % FIELD_ALIGN or field_offset % FIELD_ALIGN:
        raise ValueError(f"pool rows and fields start on {FIELD_ALIGN}-byte boundaries (ExpertLayout's)")
    if field_offset < 0 or field_offset + nbytes > pool.shape[1]:
        raise ValueError(f"{nbytes} bytes at byte {field_offset} do not fit a {pool.shape[1]}-byte row")


def _check_indices(table: torch.Tensor, ids: torch.Tensor) -> None:
    for name, index in (("slot table", table), ("top-k ids", ids)):
        if index.dtype not in (torch.int32, torch.int64) or not index.is_contiguous():
            raise ValueError(f"the {name} is a contiguous int32/int64 tensor; got {index.dtype}")


def _vector(x: torch.Tensor, n: int, name: str) -> torch.Tensor:
    """`x`'s `n` values, contiguous (as it is where it already is: the kernels read its memory)."""
    if x.numel() != n or x.dtype not in FLOATS:
        raise ValueError(f"{name} is {n} float32/bfloat16/float16 values; got {x.dtype} {tuple(x.shape)}")
    return x if x.is_contiguous() else x.reshape(n).contiguous()


def _output(
    given: torch.Tensor | None, shape: tuple[int, ...], name: str, device: torch.device, dtypes=FLOATS
) -> torch.Tensor:
    """Where a kernel writes `shape`'s values: `given` (any shape of as many, contiguous, in one of
    `dtypes`), or a new float32 tensor."""
    if given is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    if given.numel() != math.prod(shape) or given.dtype not in dtypes or not given.is_contiguous():
        raise ValueError(f"{name} takes {shape} contiguous values; got {given.dtype} {tuple(given.shape)}")
    return given


def moe_gate_up(
    x: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    field_offset: int,
    ggml_type: GGMLQuantizationType | int,
    rows: int,
    columns: int,
    block_n: int = BLOCK_N,
    act: torch.Tensor | None = None,
) -> torch.Tensor:
    """`act [K, I]` float32: silu(gate) · up of each expert `ids [K]` (its pool row `table[ids[k]]`),
    from its `gate_up_proj` field (`rows` = 2I of `columns` = H weights, at `field_offset` bytes in
    the row) and `x [H]` (or `[1, H]`); written into `act` where given (`K · I` float32 values).
    Reads nothing on the host."""
    kind = _checked_type(ggml_type, columns)
    if rows % 2:
        raise ValueError(f"gate_up_proj holds gate and up rows, an even count; got {rows}")
    _check_field(pool, field_offset, rows * row_bytes(kind, columns))
    _check_indices(table, ids)
    x, top_k, inter = _vector(x, columns, "x"), ids.numel(), rows // 2
    act = _output(act, (top_k, inter), "act", x.device, (torch.float32,))
    grid = (triton.cdiv(inter, block_n), top_k)
    with launch_range(f"moe_gate_up_{GGMLQuantizationType(kind).name.lower()}"):
        moe_gate_up_kernel[grid](
            x, pool, table, ids, act, pool.shape[1], field_offset, inter, columns,
            GGML_TYPE=kind, BLOCK_N=block_n, **LAUNCH,
        )  # fmt: skip
    return act


def moe_down(
    act: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    field_offset: int,
    ggml_type: GGMLQuantizationType | int,
    rows: int,
    columns: int,
    block_n: int = BLOCK_N,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`out [H]` float32 = Σ_k weights[k] · down(ids[k]) @ act[k], summed in k's order, from each
    expert's `down_proj` field (`rows` = H of `columns` = I weights, at `field_offset` bytes in its
    row) and `act [K, I]` (`moe_gate_up`'s); written into `out` where given (H float values of any
    shape, the float32 sums rounded once to its dtype as they are stored). Reads nothing on the host."""
    kind = _checked_type(ggml_type, columns)
    _check_field(pool, field_offset, rows * row_bytes(kind, columns))
    _check_indices(table, ids)
    top_k = ids.numel()
    act = _vector(act, top_k * columns, "act")
    weights = _vector(weights, top_k, "the routing weights")
    out = _output(out, (rows,), "out", act.device)
    with launch_range(f"moe_down_{GGMLQuantizationType(kind).name.lower()}"):
        moe_down_kernel[(triton.cdiv(rows, block_n),)](
            act, pool, table, ids, weights, out, pool.shape[1], field_offset, rows, columns, top_k,
            GGML_TYPE=kind, BLOCK_N=block_n, **LAUNCH,
        )  # fmt: skip
    return out


def quantized_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    ggml_type: GGMLQuantizationType | int,
    out_features: int,
    in_features: int,
    block_n: int = BLOCK_N,
) -> torch.Tensor:
    """`W @ x` float32 `[out_features]` for `W [out_features, in_features]` in ggml blocks (uint8, its
    rows of blocks back to back) and `x [in_features]` (or `[1, in_features]`)."""
    kind = _checked_type(ggml_type, in_features)
    if blocks.dtype != torch.uint8 or blocks.numel() != out_features * row_bytes(kind, in_features):
        raise ValueError(f"the blocks do not hold a {out_features}×{in_features} weight")
    x, blocks = _vector(x, in_features, "x"), blocks.contiguous()
    out = torch.empty(out_features, dtype=torch.float32, device=x.device)
    with launch_range(f"quantized_gemv_{GGMLQuantizationType(kind).name.lower()}"):
        quantized_gemv_kernel[(triton.cdiv(out_features, block_n),)](
            x, blocks, out, out_features, in_features, GGML_TYPE=kind, BLOCK_N=block_n, **LAUNCH
        )
    return out


# -- the FP8 and int4 families' launches: a projection object gives their fields' ints ---------------


def routed_gate_up(kernel, label: str, constexprs: dict, x, pool, table, ids, projection, block_n, act):
    """`moe_gate_up` of a family whose `projection` (engine.gpu.projections) gives its fields as
    `ints` and `spans`: the same checks and launch for FP8 and int4, `kernel` their JIT kernel."""
    if projection.rows % 2:
        raise ValueError(f"gate_up_proj holds gate and up rows, an even count; got {projection.rows}")
    for offset, nbytes in projection.spans:
        _check_field(pool, offset, nbytes)
    _check_indices(table, ids)
    x, top_k, inter = _vector(x, projection.columns, "x"), ids.numel(), projection.rows // 2
    act = _output(act, (top_k, inter), "act", x.device, (torch.float32,))
    with launch_range(f"moe_gate_up_{label}"):
        kernel[(triton.cdiv(inter, block_n), top_k)](
            x, pool, table, ids, act, pool.shape[1], *projection.ints, inter, projection.columns,
            **constexprs, BLOCK_N=block_n, **LAUNCH,
        )  # fmt: skip
    return act


def routed_down(
    kernel, label: str, constexprs: dict, act, pool, table, ids, weights, projection, block_n, out
):
    """`moe_down` of such a family (see `routed_gate_up`)."""
    for offset, nbytes in projection.spans:
        _check_field(pool, offset, nbytes)
    _check_indices(table, ids)
    top_k, rows, columns = ids.numel(), projection.rows, projection.columns
    act = _vector(act, top_k * columns, "act")
    weights = _vector(weights, top_k, "the routing weights")
    out = _output(out, (rows,), "out", act.device)
    with launch_range(f"moe_down_{label}"):
        kernel[(triton.cdiv(rows, block_n),)](
            act, pool, table, ids, weights, out, pool.shape[1], *projection.ints, rows, columns, top_k,
            **constexprs, BLOCK_N=block_n, **LAUNCH,
        )  # fmt: skip
    return out
