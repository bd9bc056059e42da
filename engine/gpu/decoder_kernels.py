"""The standard decoder's one-token work around attention and the experts, in Triton: add + RMS
norm, q/k norms + rotary + KV write, the router's top-k. For a CUDA graph of the whole step: the
position is read on the device (`pos`, one int64), so the launches are the same at every position.

Contracts (every tensor contiguous, on one device; `dt` the hidden states' dtype, float32 or
bfloat16 — the cubins are built for those, the wrappers launch any float dtype through the JIT):

- `add_rms_norm(x, residual, weight, eps, out)`: `residual [R, W]` += `x [R, W]` in place (the sum
  in float32, rounded to the residual's dtype, as torch's `residual.add_(x)`), then `out [R, W]` =
  Llama's RMSNorm of the new residual; `rms_norm(x, weight, eps, out)` the norm alone (the first
  layer's input norm; the q/k norms of a family that norms per head: rows = heads, W = head_dim).
  The norm as transformers' `…RMSNorm.forward` computes it: h = x in float32, variance = Σ h² / W
  (an IEEE division), h · (1 / sqrt(variance + eps)) (IEEE square root and division: torch's
  rsqrt on the CPU), rounded to the input's dtype, then weight · that, rounded to `out`'s dtype.
  Only the sum's order differs from torch's. Grid `(R,)`; kernel `rms_norm_kernel(ADD)`.
- `rope_kv_write(q, k, v, cos, sin, pos, key_cache, value_cache, q_norm, k_norm, eps, q_out)`:
  q `[heads, D]`, k and v `[kv_heads, D]` (the projections of one token, viewed per head); with
  `q_norm`/`k_norm` (`[D]`, Qwen3's) each head first normed as above; then transformers'
  `apply_rotary_pos_emb` with cos and sin the rows `pos` of tables `[positions, D]` (the rotary
  module's cos and sin of positions 0…, in `dt`): x · cos + rotate_half(x) · sin, each operation
  rounded to `dt` as torch rounds it (bit for bit without the norms). Writes the rotated q to
  `q_out [heads, D]`, the rotated k and v to `key_cache`/`value_cache [1, kv_heads, capacity, D]`
  at position `pos` (transformers' StaticCache layout), in place. A position past the capacity
  writes no cache row, one past the table reads its last row: the buffers are never overrun.
  Grid `(heads + kv_heads,)`; kernel `rope_kv_write_kernel(QK_NORM, HEAD_DIM)`.
- `router_top_k(logits, top_k, renormalize, ids, weights)`: logits `[T, E]` (E ≤ 512) → `ids
  [T, K]` int64, `weights [T, K]` in `weights`' dtype (the logits' by default), K ≤ 16, as the
  Qwen3-MoE / Mixtral / OLMoE routers compute them: softmax in float32 (exp(l − max) / Σ), the K
  largest probabilities in descending order, divided by their sum where `renormalize`
  (norm_topk_prob), cast. Among equal probabilities the lowest expert comes first; torch.topk on
  the CPU orders ties in no documented order (three equal values at 1, 3, 4 come as 1, 4, 3), so a
  route with exact ties may take another of the tied experts at the K-th place. Grid `(T,)`.

The attention between them is `engine.gpu.decode_attention`'s. Each wrapper checks its arguments
(ValueError) and launches through Triton's JIT (its interpreter with TRITON_INTERPRET=1); the
ahead-of-time build compiles the same kernels (`engine.gpu.registry.decoder_specs`, `head_specs`)
with `enable_fp_fusion=False`, as `LAUNCH` here: a product and a sum are rounded apart, as torch's
separate operators round them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.gpu.launch_ranges import launch_range
from engine.gpu.registry import NORM_BLOCK, ROUTER_BLOCK_E, ROUTER_MAX_K

LAUNCH = {"num_warps": 4, "enable_fp_fusion": False}
FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def rounded(x, dtype: tl.constexpr):
    """float32 `x` rounded to the nearest `dtype` value (ties to even, as torch and the GPU's
    conversion round), as float32: a store of it to `dtype` is exact. bfloat16's rounding is written
    out: Triton's interpreter truncates where the GPU rounds."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)  # NaN stays NaN
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _rstd(sum_of_squares, width, eps):
    """1 / sqrt(Σ h² / width + eps), each step rounded as IEEE rounds it (torch's mean and rsqrt)."""
    variance = tl.math.div_rn(sum_of_squares, width.to(tl.float32))
    return tl.math.div_rn(1.0, tl.sqrt_rn(variance + eps))


@triton.jit
def _normed(h, rstd, weight, dtype: tl.constexpr):
    """weight · (h · rstd rounded to `dtype`), float32, not rounded yet."""
    return weight.to(tl.float32) * rounded(h * rstd, dtype)


@triton.jit
def rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, width, eps,
    ADD: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid `(rows,)`: with ADD residual[row] += x[row] and out[row] = norm(residual[row]), else
    out[row] = norm(x[row]) (residual unread); `BLOCK` columns at a time."""
    start = tl.program_id(0).to(tl.int64) * width
    cols = tl.arange(0, BLOCK)
    source = residual_ptr + start if ADD else x_ptr + start  # what is normed
    squares = tl.zeros((BLOCK,), dtype=tl.float32)
    for first in range(0, width, BLOCK):
        inside = first + cols < width
        h = tl.load(x_ptr + start + first + cols, mask=inside, other=0.0).to(tl.float32)
        if ADD:
            residual = tl.load(source + first + cols, mask=inside, other=0.0).to(tl.float32)
            h = rounded(residual + h, source.dtype.element_ty)
            tl.store(source + first + cols, h, mask=inside)
        squares += h * h
    rstd = _rstd(tl.sum(squares, axis=0), width, eps)
    for first in range(0, width, BLOCK):
        inside = first + cols < width
        # the residual as this thread stored it above (the same offsets: the same thread's values)
        h = tl.load(source + first + cols, mask=inside, other=0.0).to(tl.float32)
        weight = tl.load(weight_ptr + first + cols, mask=inside, other=0.0)
        normed = _normed(h, rstd, weight, source.dtype.element_ty)
        tl.store(out_ptr + start + first + cols, rounded(normed, out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_rope(row_ptr, weight_ptr, cos, sin, eps, QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """One head `[HEAD_DIM]` at `row_ptr`, normed (QK_NORM) and rotated: float32 values of its dtype."""
    dtype = row_ptr.dtype.element_ty
    d = tl.arange(0, HEAD_DIM)
    partner = (d + HEAD_DIM // 2) % HEAD_DIM  # rotate_half(x)[d] = ∓x[partner]
    x = tl.load(row_ptr + d).to(tl.float32)
    x_partner = tl.load(row_ptr + partner).to(tl.float32)
    if QK_NORM:
        rstd = _rstd(tl.sum(x * x, axis=0), tl.full((), HEAD_DIM, tl.int32), eps)
        x = rounded(_normed(x, rstd, tl.load(weight_ptr + d), dtype), dtype)
        x_partner = rounded(_normed(x_partner, rstd, tl.load(weight_ptr + partner), dtype), dtype)
    rotated = tl.where(d < HEAD_DIM // 2, -x_partner, x_partner)
    return rounded(rounded(x * cos, dtype) + rounded(rotated * sin, dtype), dtype)


@triton.jit
def rope_kv_write_kernel(
    q_ptr, k_ptr, v_ptr, q_norm_ptr, k_norm_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr,
    key_cache_ptr, value_cache_ptr, heads, kv_heads, capacity, table_rows, eps,
    QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """Grid `(heads + kv_heads,)`: program h < heads rotates q's head h into q_out; program
    heads + j rotates k's head j into key_cache[0, j, pos] and copies v's into value_cache[0, j, pos]."""
    head = tl.program_id(0)
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(pos_ptr).to(tl.int64)
    angle = tl.minimum(pos, table_rows - 1) * HEAD_DIM
    cos = tl.load(cos_ptr + angle + d).to(tl.float32)
    sin = tl.load(sin_ptr + angle + d).to(tl.float32)
    if head < heads:
        rotated = _norm_rope(q_ptr + head * HEAD_DIM, q_norm_ptr, cos, sin, eps, QK_NORM, HEAD_DIM)
        tl.store(q_out_ptr + head * HEAD_DIM + d, rotated)
    else:
        kv_head = head - heads
        rotated = _norm_rope(k_ptr + kv_head * HEAD_DIM, k_norm_ptr, cos, sin, eps, QK_NORM, HEAD_DIM)
        row = (kv_head.to(tl.int64) * capacity + pos) * HEAD_DIM
        inside = (d < HEAD_DIM) & (pos < capacity)
        tl.store(key_cache_ptr + row + d, rotated, mask=inside)
        tl.store(value_cache_ptr + row + d, tl.load(v_ptr + kv_head * HEAD_DIM + d), mask=inside)


@triton.jit
def router_top_k_kernel(
    logits_ptr, ids_ptr, weights_ptr, experts, top_k, renormalize,
    BLOCK_E: tl.constexpr, MAX_K: tl.constexpr,
):  # fmt: skip
    """Grid `(tokens,)`: the token's softmax over `experts` logits, its `top_k` largest (the lowest
    expert first among equal ones), renormalized unless `renormalize` is 0."""
    token = tl.program_id(0).to(tl.int64)
    expert = tl.arange(0, BLOCK_E)
    inside = expert < experts
    logits = tl.load(logits_ptr + token * experts + expert, mask=inside, other=float("-inf"))
    logits = logits.to(tl.float32)
    exps = tl.exp(logits - tl.max(logits, axis=0))  # 0 past the experts
    probs = tl.math.div_rn(exps, tl.sum(exps, axis=0))
    left = tl.where(inside, probs, -1.0)  # the experts not taken yet: probabilities are ≥ 0
    slot = tl.arange(0, MAX_K)
    top_ids = tl.zeros((MAX_K,), dtype=tl.int32)
    top = tl.zeros((MAX_K,), dtype=tl.float32)
    for k in range(0, top_k):
        best = tl.max(left, axis=0)
        chosen = tl.min(tl.where(left == best, expert, BLOCK_E), axis=0)
        chosen = tl.minimum(chosen, experts - 1)  # NaN logits: some expert, never past the table
        top_ids = tl.where(slot == k, chosen, top_ids)
        top = tl.where(slot == k, best, top)
        left = tl.where(expert == chosen, -1.0, left)
    total = tl.where(renormalize != 0, tl.sum(top, axis=0), 1.0)  # the slots past top_k hold 0
    taken = slot < top_k
    tl.store(ids_ptr + token * top_k + slot, top_ids.to(tl.int64), mask=taken)
    weights = rounded(tl.math.div_rn(top, total), weights_ptr.dtype.element_ty)
    tl.store(weights_ptr + token * top_k + slot, weights, mask=taken)


# -- host side: checks and launches through Triton's JIT -------------------------------------------


def _check(tensor: torch.Tensor, name: str, shape: tuple[int, ...], dtypes=FLOATS) -> torch.Tensor:
    """`tensor` itself where it is contiguous, of `shape` and one of `dtypes` (the kernels read
    and write its memory), else a ValueError naming it."""
    if tuple(tensor.shape) != shape or tensor.dtype not in dtypes or not tensor.is_contiguous():
        names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(
            f"{name} is a contiguous {names} tensor {shape}; got {tensor.dtype} {tuple(tensor.shape)}"
        )
    return tensor


def check_device(pos: torch.Tensor | None, *tensors: torch.Tensor) -> None:
    """Every tensor on one device; the step's position `pos` (where there is one) one int64 (or
    int32) there too: the kernels read it on the device, never the host."""
    devices = {t.device for t in tensors if t is not None}
    if len(devices) != 1:
        raise ValueError(f"the kernel's tensors are on one device; got {sorted(map(str, devices))}")
    if pos is not None and (pos.numel() != 1 or pos.dtype not in (torch.int64, torch.int32)):
        raise ValueError(f"pos is one int64 on the device; got {pos.dtype} {tuple(pos.shape)}")


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the kernels take heads of a power of two ≥ 16 values; got {head_dim}")


def _rows(tensor: torch.Tensor) -> tuple[int, int]:
    if tensor.dim() != 2:
        raise ValueError(f"the norm's rows are [R, W]; got {tuple(tensor.shape)}")
    return tuple(tensor.shape)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`residual [R, W]` += `x [R, W]` in place; returns `out [R, W]` = RMSNorm(residual) · weight
    (the module doc's contract; `out` new, in the dtype torch's norm gives, unless given)."""
    return _rms_norm(x, residual, weight, eps, out, add=True)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """`out [R, W]` = RMSNorm(x [R, W]) · weight `[W]` (the module doc's contract)."""
    return _rms_norm(x, x, weight, eps, out, add=False)


def _rms_norm(x, residual, weight, eps, out, add: bool) -> torch.Tensor:
    shape = _rows(residual)
    _check(x, "x", shape)
    _check(residual, "the residual", shape)
    _check(weight, "the norm's weight", shape[1:])
    if out is None:
        out = residual.new_empty(shape, dtype=torch.promote_types(weight.dtype, residual.dtype))
    _check(out, "out", shape)
    check_device(None, x, residual, weight, out)
    with launch_range("add_rms_norm" if add else "rms_norm"):
        rms_norm_kernel[(shape[0],)](
            x, residual, weight, out, shape[1], eps, ADD=add, BLOCK=NORM_BLOCK, **LAUNCH
        )  # fmt: skip
    return out


def rope_kv_write(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_norm: torch.Tensor | None = None,
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    q_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rotated q `[heads, D]` (into `q_out` where given); k and v rotated and copied into the
    caches `[1, kv_heads, capacity, D]` at the device position `pos` (the module doc's contract)."""
    heads, head_dim = q.shape if q.dim() == 2 else (-1, -1)
    kv_heads, capacity = (key_cache.shape[1], key_cache.shape[2]) if key_cache.dim() == 4 else (-1, -1)
    check_head_dim(head_dim)
    dtype = (q.dtype,)  # the rounding of every operation: one dtype for all
    _check(q, "q", (heads, head_dim))
    for name, tensor in (("k", k), ("v", v)):
        _check(tensor, name, (kv_heads, head_dim), dtype)
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
        _check(tensor, name, (1, kv_heads, capacity, head_dim), dtype)
    table_rows = cos.shape[0]
    for name, table in (("cos", cos), ("sin", sin)):
        _check(table, f"the {name} table", (table_rows, head_dim), dtype)
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together (a family norms both or neither)")
    if q_norm is not None:
        _check(q_norm, "q_norm", (head_dim,), dtype)
        _check(k_norm, "k_norm", (head_dim,), dtype)
    q_out = torch.empty_like(q) if q_out is None else _check(q_out, "q_out", (heads, head_dim), dtype)
    check_device(pos, q, k, v, cos, sin, pos, key_cache, value_cache, q_norm, k_norm, q_out)
    norms = (q, k) if q_norm is None else (q_norm, k_norm)  # unread without the norms
    with launch_range("rope_kv_write"):
        rope_kv_write_kernel[(heads + kv_heads,)](
            q, k, v, *norms, cos, sin, pos, q_out, key_cache, value_cache,
            heads, kv_heads, capacity, table_rows, eps,
            QK_NORM=q_norm is not None, HEAD_DIM=head_dim, **LAUNCH,
        )  # fmt: skip
    return q_out


def router_top_k(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(ids [T, K] int64, weights [T, K])` of router `logits [T, E]` (or `[E]`: then `[K]` each),
    written into `ids`/`weights` where given (the module doc's contract)."""
    if logits.dim() not in (1, 2) or not 1 <= logits.shape[-1] <= ROUTER_BLOCK_E:
        raise ValueError(f"the router's logits are [T, E], E ≤ {ROUTER_BLOCK_E}; got {tuple(logits.shape)}")
    tokens, experts = logits.shape if logits.dim() == 2 else (1, logits.shape[0])
    _check(logits, "the router logits", tuple(logits.shape))
    if not 1 <= top_k <= min(experts, ROUTER_MAX_K):
        raise ValueError(f"top_k is 1 to {min(experts, ROUTER_MAX_K)} here; got {top_k}")
    shape = (*logits.shape[:-1], top_k)
    ids = torch.empty(shape, dtype=torch.int64, device=logits.device) if ids is None else ids
    weights = torch.empty(shape, dtype=logits.dtype, device=logits.device) if weights is None else weights
    _check(ids, "ids", shape, (torch.int64,))
    _check(weights, "weights", shape)
    check_device(None, logits, ids, weights)
    with launch_range("router_top_k"):
        router_top_k_kernel[(tokens,)](
            logits, ids, weights, experts, top_k, int(renormalize),
            BLOCK_E=ROUTER_BLOCK_E, MAX_K=ROUTER_MAX_K, **LAUNCH,
        )  # fmt: skip
    return ids, weights
