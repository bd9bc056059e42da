"""The decoder kernels' cases (`case.Case`) and the smoke kernel's: add + RMS norm and the norm
alone, q/k norms + rotary + KV write, the router's top-k, the attention's split and reduce, at a
Qwen3-30B-A3B layer's shapes, the position an int64 on the device.

The references are torch's operations as transformers' Qwen3-MoE modules compute them
(`Qwen3MoeRMSNorm`, `apply_rotary_pos_emb`, `Qwen3MoeTopKRouter`, `eager_attention_forward`;
tests/engine/gpu/test_checks.py holds these functions to those modules). Bit for bit where the
kernels run the reference's operations in its order: the residual's sum, the rotary without the
norms, the smoke kernel. The attention's split is judged on its partials (each split's max, sum of
exponentials and Σ p · v, in float64), its reduce on the attention itself; the timed launches of
the split read other layers' caches in turn (`Shapes.timing_bytes` of them).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from engine.gpu.checks.case import DTYPES, Case, Launch, Shapes
from engine.gpu.checks.experts import normal
from engine.gpu.registry import ATTENTION_BLOCK_H, SMOKE, attention_splits

EPS = 1e-6
ROPE_THETA = 1e6  # Qwen3-30B-A3B's


def llama_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = EPS) -> torch.Tensor:
    """`Qwen3MoeRMSNorm.forward`: x normed in float32, rounded to its dtype, times the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotary_tables(positions: int, head_dim: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, ...]:
    """cos and sin `[positions, head_dim]` as transformers' default rotary embedding makes them."""
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(positions, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rotary_pos_emb` of heads `x [n, D]` at one position (`cos`, `sin` `[D]`)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def smoke_case(shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """`out = x · 0.3 + y`, the product and the sum rounded apart, as torch rounds them."""
    n = 5000  # not a multiple of the block: the mask works
    x, y = normal(rng, n).to(device), normal(rng, n).to(device)
    out = torch.full((n,), float("nan"), device=device)
    grid = (-(-n // SMOKE.constexprs["BLOCK"]),)
    launch = Launch(SMOKE.name, grid, (x, y, out, n, 0.3), ("smoke",))
    return Case((launch,), lambda: {"smoke": (out, x * 0.3 + y)}, frozenset({"smoke"}))


def norm_case(add: bool, x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """One token's add + RMS norm (`add`: the residual += x in place, then its norm) or its norm."""
    dtype, width = DTYPES[x_dtype], shapes.hidden
    x, residual = (normal(rng, 1, width).to(device, dtype) for _ in range(2))
    weight = (normal(rng, width) + 1).to(device, dtype)
    out, before = torch.empty(1, width, dtype=dtype, device=device), residual.clone()
    args = (x, residual if add else x, weight, out, width, EPS)
    name = f"{'add_' if add else ''}rms_norm_{x_dtype}"

    def compare() -> dict:
        if not add:
            return {"normed": (out, llama_rms_norm(x, weight))}
        summed = before + x
        return {"residual": (residual, summed), "normed": (out, llama_rms_norm(summed, weight))}

    judged = ("residual", "normed") if add else ("normed",)
    return Case((Launch(name, (1,), args, judged),), compare, frozenset({"residual"}))


def rope_case(qk_norm: bool, x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """One token's q, k and v heads: q and k normed per head (`qk_norm`, Qwen3's) and rotated at the
    device position, q into `q_out`, k and v into the caches' row at that position."""
    dtype, heads, kv_heads, d, capacity = (
        DTYPES[x_dtype], shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.capacity
    )  # fmt: skip
    pos = capacity * 3 // 4 + 5
    q, k, v = (normal(rng, n, d).to(device, dtype) for n in (heads, kv_heads, kv_heads))
    norms = [(normal(rng, d) + 1).to(device, dtype) for _ in range(2)] if qk_norm else [q, k]  # unread
    cos, sin = rotary_tables(capacity, d, dtype, device)
    key_cache, value_cache = (torch.zeros(1, kv_heads, capacity, d, dtype=dtype, device=device) for _ in "kv")
    q_out, position = torch.empty_like(q), torch.tensor([pos], device=device)
    caches = (key_cache, value_cache)
    args = (q, k, v, *norms, cos, sin, position, q_out, *caches, heads, kv_heads, capacity, len(cos), EPS)
    name = f"rope_kv_write{'_qk_norm' if qk_norm else ''}_d{d}_{x_dtype}"

    def compare() -> dict:
        normed = (llama_rms_norm(q, norms[0]), llama_rms_norm(k, norms[1])) if qk_norm else (q, k)
        want_q, want_k = (rotated(h, cos[pos], sin[pos]) for h in normed)
        got_k, got_v = key_cache[0, :, pos], value_cache[0, :, pos]
        return {"q": (q_out, want_q), "k": (got_k, want_k), "v": (got_v, v)}

    launch = Launch(name, (heads + kv_heads,), args, ("q", "k", "v"))
    return Case((launch,), compare, frozenset({"v"} if qk_norm else {"q", "k", "v"}))


def router_case(x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """Router logits `[tokens, experts]` → each token's top-k ids and renormalized weights (Qwen3-MoE's
    norm_topk_prob). The route is judged by the reference's probabilities of the experts taken."""
    dtype, tokens, experts, top_k = DTYPES[x_dtype], shapes.tokens, shapes.router_experts, shapes.top_k
    logits = (normal(rng, tokens, experts) * 2).to(device, dtype)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(tokens, top_k, dtype=dtype, device=device)

    def compare() -> dict:
        probs = torch.softmax(logits.float(), dim=-1)
        top, _ = torch.topk(probs, top_k)
        taken = probs.gather(-1, ids.clamp(0, experts - 1))  # equal probabilities: either expert
        return {"weights": (weights, (top / top.sum(-1, keepdim=True)).to(dtype)), "route": (taken, top)}

    args = (logits, ids, weights, experts, top_k, 1)
    return Case((Launch(f"router_top_k_{x_dtype}", (tokens,), args, ("weights", "route")),), compare)


def attention_case(x_dtype: str, shapes: Shapes, device, rng: np.random.Generator) -> Case:
    """One query token over the first pos + 1 positions of a layer's cache: the split kernel's
    partials, then the reduce kernel's attention."""
    dtype, heads, kv_heads, d, capacity = (
        DTYPES[x_dtype], shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.capacity
    )  # fmt: skip
    group, (splits, split_len) = heads // kv_heads, attention_splits(capacity)
    pos = capacity * 7 // 8 - 37  # inside a split; the splits past it empty
    layers = 1 + -(-shapes.timing_bytes // (2 * kv_heads * capacity * d * dtype.itemsize))
    generator = torch.Generator(device).manual_seed(0)
    keys, values = (
        torch.randn(layers, 1, kv_heads, capacity, d, generator=generator, device=device).to(dtype)
        for _ in "kv"
    )
    q, position = (normal(rng, heads, d) * 2).to(device, dtype), torch.tensor([pos], device=device)
    partial = torch.empty(heads, splits, d, device=device)
    maxes, sums = torch.empty(heads, splits, device=device), torch.empty(heads, splits, device=device)
    out, scaling = torch.empty(heads, d, dtype=dtype, device=device), d**-0.5

    def split_args(layer: int) -> tuple:
        cache = (keys[layer], values[layer])
        return (q, *cache, position, partial, maxes, sums, group, capacity, split_len, splits, scaling)

    grid = (kv_heads * -(-group // ATTENTION_BLOCK_H), splits)
    read = 2 * kv_heads * (pos + 1) * d * dtype.itemsize
    split = Launch(
        f"decode_attention_split_d{d}_{x_dtype}",
        grid,
        split_args(0),
        ("partial", "max", "sum"),
        read,
        tuple(split_args(layer) for layer in range(layers)),
    )
    reduce = Launch(
        f"decode_attention_reduce_d{d}_{x_dtype}",
        (heads,),
        (partial, maxes, sums, out, splits),
        ("attention",),
    )

    def compare() -> dict:
        want = attention_reference(q, keys[0], values[0], pos, scaling, split_len * splits, split_len)
        got = {"partial": partial, "max": maxes, "sum": sums, "attention": out}
        return {name: (got[name], want[name]) for name in got}

    return Case((split, reduce), compare)


def attention_reference(q, keys, values, pos: int, scaling: float, span: int, split_len: int) -> dict:
    """float64: `eager_attention_forward` of `q [heads, D]` over positions 0 … pos of `keys` and
    `values` `[1, kv_heads, capacity, D]` (GQA: query head h reads KV head h // group), and each
    split of `split_len` positions' max score, sum of exponentials and Σ p · v (−inf, 0 and zeros
    past the length), the positions padded to `span`."""
    heads, d = q.shape
    kv_heads, length = keys.shape[1], pos + 1
    k, v = keys[0, :, :length].double(), values[0, :, :length].double()  # [kv, L, D]
    scores = torch.einsum("kgd,ktd->kgt", q.double().view(kv_heads, -1, d), k) * scaling
    attention = torch.einsum("kgt,ktd->kgd", scores.softmax(-1), v).reshape(heads, d)
    splits = span // split_len
    padded = F.pad(scores, (0, span - length), value=float("-inf")).unflatten(-1, (splits, split_len))
    top = padded.amax(-1)  # [kv, group, splits]
    p = torch.exp(padded - torch.where(top.isinf(), 0.0, top)[..., None])
    v_splits = F.pad(v, (0, 0, 0, span - length)).unflatten(1, (splits, split_len))
    partial = torch.einsum("kgsl,ksld->kgsd", p, v_splits)
    return {
        "partial": partial.reshape(heads, splits, d),
        "max": top.reshape(heads, splits),
        "sum": p.sum(-1).reshape(heads, splits),
        "attention": attention,
    }
