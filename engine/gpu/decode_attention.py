"""One query token's attention over a static KV cache, flash-decoding style, in Triton: the length
is read on the device, so a CUDA graph of the step replays the same launches at every position.

Contract: `decode_attention(q, key_cache, value_cache, pos, scaling, out, workspace)` — q
`[heads, D]` (the rotated query of one token, `engine.gpu.decoder_kernels.rope_kv_write`'s
`q_out`), the layer's caches `[1, kv_heads, capacity, D]` (transformers' StaticCache layout, the
token's own k and v already written at `pos`), `pos` one int64 on the device: `out [heads, D]` in
q's dtype = softmax(q · kᵀ · scaling) · v over positions 0 … pos (length = pos + 1, capped at the
capacity), query head h reading KV head h // (heads / kv_heads) (GQA; repeat_kv's order).
Positions past pos are never read (they may hold anything). `[heads, D]` is the memory of
transformers' attention output `[1, 1, heads, D]`: o_proj reads it as `[1, 1, heads·D]`.

Numerics: the softmax (exp(s − running max)), its sums and the weighted sum of v accumulate in
float32, and the output is rounded once, as it is stored. The products run on tensor cores: q · k
in TF32 for bfloat16 caches (TF32 holds bfloat16 values exactly: exact products), in 3xTF32 for
float32 ones (each operand split in two TF32 parts: about 2⁻²¹ of each product); p · v in 3xTF32
(p split so). Triton's interpreter multiplies in float32: the CPU tests check the algorithm, the
tensor cores' rounding is the GPU check's.

Two launches, their grids fixed by the capacity (`registry.attention_splits`), not by the length:

- `decode_attention_split_kernel`, grid `(kv_heads · cdiv(group, BLOCK_H), splits)`: a program
  takes one KV head's query heads (up to BLOCK_H of them) and one split of `split_len` positions,
  and writes that split's running max, sum of exponentials and unnormalized Σ p · v (float32, in
  `workspace`); a split past the length writes max −inf, sum 0 and zeros;
- `decode_attention_reduce_kernel`, grid `(heads,)`: each query head's splits combined (rescaled
  to the largest max), divided by the total sum.

`workspace = attention_workspace(heads, capacity, head_dim, device)` holds the partials; a CUDA
graph keeps one per step (layers may share it: they run one after another). Built ahead of time
by `engine.gpu.registry.head_specs`, with `enable_fp_fusion=False` as `LAUNCH` here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.gpu import registry
from engine.gpu.decoder_kernels import FLOATS, check_device, check_head_dim, rounded
from engine.gpu.launch_ranges import launch_range
from engine.gpu.registry import ATTENTION_BLOCK_H, ATTENTION_BLOCK_T, ATTENTION_MAX_SPLITS, ATTENTION_WARPS

LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}  # as the build compiles them (the reduce kernel)
SPLIT_LAUNCH = LAUNCH | {"num_warps": ATTENTION_WARPS}
# the grids come from the capacity alone (`registry.attention_splits`: the cubins' launches
# compute them where triton is not installed)


HEAD_CHUNK: tl.constexpr = tl.constexpr(32)  # a head's values a q·k product takes at a time


@triton.jit
def _dot(a, b, dtype: tl.constexpr):
    """a @ b of float32 operands holding `dtype` values, on tensor cores: TF32 holds bfloat16's
    values exactly (exact products, float32 sums), 3xTF32 splits float32 ones."""
    if dtype == tl.bfloat16:
        return tl.dot(a, b, input_precision="tf32")
    else:
        return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _scores(
    q_rows, real, key_rows, seen, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr
):
    """q · kᵀ `[BLOCK_H, BLOCK_T]` for query rows `q_rows [BLOCK_H, 1]` and key rows `key_rows
    [BLOCK_T, 1]` (pointers), HEAD_CHUNK values at a time: a warp holds a chunk of q, not all of it."""
    scores = tl.zeros((BLOCK_H, BLOCK_T), dtype=tl.float32)
    for first in tl.static_range(0, HEAD_DIM, HEAD_CHUNK):
        d = first + tl.arange(0, HEAD_CHUNK)[None, :]
        q = tl.load(q_rows + d, mask=real[:, None], other=0.0).to(tl.float32)
        keys = tl.load(key_rows + d, mask=seen[:, None], other=0.0).to(tl.float32)
        scores += _dot(q, tl.trans(keys), q_rows.dtype.element_ty)
    return scores


@triton.jit
def decode_attention_split_kernel(
    q_ptr, key_cache_ptr, value_cache_ptr, pos_ptr, partial_ptr, max_ptr, sum_ptr,
    group, capacity, split_len, splits, scaling,
    HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    """Grid `(kv_heads · cdiv(group, BLOCK_H), splits)`: query heads of one KV head over positions
    split · split_len … below the length; their partials at [head, split]."""
    head_blocks = tl.cdiv(group, BLOCK_H)
    kv_head = tl.program_id(0) // head_blocks
    member = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)  # in the group
    heads = kv_head * group + member  # [BLOCK_H] query heads; those past the group masked
    real = member < group
    split = tl.program_id(1)
    d = tl.arange(0, HEAD_DIM)
    length = tl.minimum(tl.load(pos_ptr).to(tl.int32) + 1, capacity)
    start = split * split_len
    end = tl.minimum(start + split_len, length)
    base = kv_head.to(tl.int64) * capacity * HEAD_DIM
    running_max = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    running_sum = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, HEAD_DIM), dtype=tl.float32)
    for first in range(start, end, BLOCK_T):  # every block holds a position below `end`
        t = first + tl.arange(0, BLOCK_T)
        seen = t < end
        rows = base + t[:, None].to(tl.int64) * HEAD_DIM  # [BLOCK_T, 1]
        scores = _scores(
            q_ptr + heads[:, None] * HEAD_DIM, real, key_cache_ptr + rows, seen, BLOCK_H, BLOCK_T, HEAD_DIM
        )
        scores = tl.where(seen[None, :], scores * scaling, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        rescale = tl.exp(running_max - new_max)  # 0 on the first block (−inf − finite)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(p, axis=1)
        values = tl.load(value_cache_ptr + rows + d[None, :], mask=seen[:, None], other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(p, values, input_precision="tf32x3")
        running_max = new_max
    at = heads * splits + split  # [BLOCK_H]
    tl.store(max_ptr + at, running_max, mask=real)
    tl.store(sum_ptr + at, running_sum, mask=real)
    tl.store(partial_ptr + at[:, None].to(tl.int64) * HEAD_DIM + d[None, :], acc, mask=real[:, None])


@triton.jit
def decode_attention_reduce_kernel(
    partial_ptr, max_ptr, sum_ptr, out_ptr, splits, HEAD_DIM: tl.constexpr, MAX_SPLITS: tl.constexpr
):
    """Grid `(heads,)`: out[head] = Σ_s e^(max_s − M) · partial_s / Σ_s e^(max_s − M) · sum_s."""
    head = tl.program_id(0)
    s = tl.arange(0, MAX_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    maxes = tl.load(max_ptr + head * splits + s, mask=s < splits, other=float("-inf"))
    top = tl.max(maxes, axis=0)  # finite: split 0 holds position 0
    total = tl.sum(tl.exp(maxes - top) * tl.load(sum_ptr + head * splits + s, mask=s < splits, other=0.0))
    acc = tl.zeros((HEAD_DIM,), dtype=tl.float32)
    for split in range(0, splits):
        at = head * splits + split
        weight = tl.exp(tl.load(max_ptr + at) - top)  # 0 for a split past the length
        acc += weight * tl.load(partial_ptr + at.to(tl.int64) * HEAD_DIM + d)
    tl.store(out_ptr + head * HEAD_DIM + d, rounded(tl.math.div_rn(acc, total), out_ptr.dtype.element_ty))


def attention_workspace(
    heads: int, capacity: int, head_dim: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's outputs, float32: partial sums `[heads, splits, D]`, maxes and sums of
    exponentials `[heads, splits]`."""
    splits, _ = registry.attention_splits(capacity)
    partial = torch.empty((heads, splits, head_dim), dtype=torch.float32, device=device)
    maxes = torch.empty((heads, splits), dtype=torch.float32, device=device)
    return partial, maxes, torch.empty_like(maxes)


def _check_attention(q, key_cache, value_cache, pos, workspace) -> tuple[int, int, int, int]:
    """(heads, kv_heads, capacity, head_dim), each tensor checked (ValueError)."""
    if q.dim() != 2 or key_cache.dim() != 4 or key_cache.shape[0] != 1:
        raise ValueError(f"q is [heads, D], the caches [1, kv_heads, capacity, D]; got {tuple(q.shape)}")
    (heads, head_dim), (_, kv_heads, capacity, _) = q.shape, key_cache.shape
    check_head_dim(head_dim)
    if q.dtype not in FLOATS or not q.is_contiguous():
        raise ValueError(f"q is a contiguous float tensor; got {q.dtype}")
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        if (
            cache.shape != (1, kv_heads, capacity, head_dim)
            or cache.dtype != q.dtype
            or not cache.is_contiguous()
        ):
            raise ValueError(f"{name} is contiguous [1, {kv_heads}, {capacity}, {head_dim}] {q.dtype}")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not share {kv_heads} KV heads evenly")
    splits, _ = registry.attention_splits(capacity)
    want = ((heads, splits, head_dim), (heads, splits), (heads, splits))
    if tuple(tuple(t.shape) for t in workspace) != want or any(
        t.dtype != torch.float32 or not t.is_contiguous() for t in workspace
    ):
        raise ValueError(f"the workspace is float32 {want} (attention_workspace's)")
    check_device(pos, q, key_cache, value_cache, pos, *workspace)
    return heads, kv_heads, capacity, head_dim


def decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    pos: torch.Tensor,
    scaling: float,
    out: torch.Tensor | None = None,
    workspace: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`out [heads, D]`: one query token's attention over positions 0 … pos (the module doc's
    contract); `out` and `workspace` new unless given."""
    if workspace is None and q.dim() == 2 and key_cache.dim() == 4:
        workspace = attention_workspace(q.shape[0], key_cache.shape[2], q.shape[1], q.device)
    heads, kv_heads, capacity, head_dim = _check_attention(q, key_cache, value_cache, pos, workspace)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype not in FLOATS or not out.is_contiguous() or out.device != q.device:
        raise ValueError(f"out is a contiguous float tensor {tuple(q.shape)} on {q.device}")
    group = heads // kv_heads
    splits, split_len = registry.attention_splits(capacity)
    partial, maxes, sums = workspace
    grid = (kv_heads * triton.cdiv(group, ATTENTION_BLOCK_H), splits)
    with launch_range("decode_attention_split"):
        decode_attention_split_kernel[grid](
            q, key_cache, value_cache, pos, partial, maxes, sums,
            group, capacity, split_len, splits, scaling,
            HEAD_DIM=head_dim, BLOCK_H=ATTENTION_BLOCK_H, BLOCK_T=ATTENTION_BLOCK_T, **SPLIT_LAUNCH,
        )  # fmt: skip
    with launch_range("decode_attention_reduce"):
        decode_attention_reduce_kernel[(heads,)](
            partial, maxes, sums, out, splits, HEAD_DIM=head_dim, MAX_SPLITS=ATTENTION_MAX_SPLITS, **LAUNCH
        )
    return out
