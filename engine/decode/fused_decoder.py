"""The standard decoder's one-token work in the fused kernels, for the captured step's graph.

Contract: `FusedDecoder.of(body, device, dtype, asked)` is the kernels of `engine.gpu.decoder_kernels`
and `engine.gpu.decode_attention` a `step_body.StepBody` launches in place of its modules, or why
none apply (a str). Each piece is taken only where a probe on the model's device shows the kernel
computes what the module does (as `fused_norms` probes the norms):

    norms      every layer's input and post-attention norm and the final norm is Llama's RMSNorm
               (`add_rms_norm` adds the residual as it norms: the step's residual adds go with them)
    rotary     the family's `apply_rotary_pos_emb` is rotate_half's, q/k norms per head or none
               (`rope_kv_write`: norms, rotation and the KV write at the device position at once)
    attention  heads of a width the kernels are built for (`decode_attention`: flash-decoding over
               the buffers' capacity, the length read on the device)
    router     the MoE block's router is softmax → top-k (→ renormalized), as `router_top_k`

A piece that does not apply is computed by the modules, as the body does without kernels. The
kernels launch by their registered names (`engine.gpu.registry`): on CUDA their cubins through the
driver (`engine.gpu.launcher`; float32 and bfloat16 only), on the CPU only when asked
(`ExpertControl.fused = True`), through Triton's JIT in its interpreter with the same arguments —
for tests and for counting a step's launches.
"""

from __future__ import annotations

import functools
import importlib
import logging
import math
import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.gpu.registry import (
    ATTENTION_BLOCK_H,
    ATTENTION_BLOCK_T,
    ATTENTION_MAX_SPLITS,
    DECODER_HEAD_DIMS,
    REGISTRY,
    ROUTER_BLOCK_E,
    ROUTER_MAX_K,
)

log = logging.getLogger(__name__)

DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16"}  # what the kernels are built for
MIN_SPLIT_POSITIONS = 4 * ATTENTION_BLOCK_T  # as engine.gpu.decode_attention splits the positions
SPECS = {spec.name: spec for spec in REGISTRY}


def attention_splits(capacity: int) -> tuple[int, int]:
    """`(splits, split_len)` of a cache of `capacity` positions (`decode_attention.attention_splits`,
    written here without triton)."""
    per_split = max(MIN_SPLIT_POSITIONS, math.ceil(capacity / ATTENTION_MAX_SPLITS))
    split_len = math.ceil(per_split / ATTENTION_BLOCK_T) * ATTENTION_BLOCK_T
    return math.ceil(capacity / split_len), split_len


class Launcher:
    """Registered kernels launched by name: their cubins on CUDA, Triton's JIT on the CPU."""

    def __init__(self, device: torch.device):
        self.device = device

    def __call__(self, name: str, grid: tuple[int, ...], *args) -> None:
        if self.device.type == "cuda":
            _cubin(name, self.device.index or 0)(grid, *args)
            return
        function, constexprs, warps = _jit_spec(name)
        module, function = function.split(":")
        kernel = getattr(importlib.import_module(module), function)
        from engine.gpu.launch_ranges import launch_range

        with launch_range(name):
            kernel[grid](*args, **constexprs, num_warps=warps, enable_fp_fusion=False)


def _jit_spec(name: str) -> tuple[str, dict, int]:
    """`name`'s function, constexprs and warps; a head width the build leaves out (tiny models' in
    the interpreter) as the built width's entry with its own `HEAD_DIM`."""
    spec = SPECS.get(name)
    if spec is not None:
        return spec.function, spec.constexprs, spec.num_warps
    found = re.fullmatch(r"(.*_d)(\d+)(_.*)", name)
    if found is None:
        raise KeyError(name)
    built = SPECS[f"{found[1]}{DECODER_HEAD_DIMS[0]}{found[3]}"]
    return built.function, built.constexprs | {"HEAD_DIM": int(found[2])}, built.num_warps


@functools.cache
def _cubin(name: str, device: int):
    from engine.gpu.launcher import CubinKernel

    return CubinKernel.load(name, device=device)


class FusedDecoder:
    """The kernels a step body launches (see the module doc); None for a piece the modules compute."""

    def __init__(self, launch: Launcher, dtype: torch.dtype, norms: bool, rotary: bool, attention: bool):
        self.launch, self.suffix = launch, DTYPES[dtype]
        self.norms, self.rotary, self.attention = norms, rotary, attention
        self.routers: dict[nn.Module, Callable] = {}  # router -> its fused forward

    @classmethod
    def of(cls, body, device: torch.device, dtype: torch.dtype, asked: bool | None) -> FusedDecoder | str:
        if asked is False:
            return "turned off (ExpertControl.fused is False)"
        if device.type == "cpu" and not asked:
            return "on the CPU only when asked (ExpertControl.fused = True: Triton's interpreter)"
        if device.type not in ("cpu", "cuda") or dtype not in DTYPES:
            return f"no decoder kernels for {dtype} on {device.type}"
        launch = Launcher(device)
        head_dim = body.layers[0].head_dim
        # heads of a width with cubins; in the interpreter any, but the attention's tl.dot sums
        # 16-wide heads wrongly there
        built = head_dim in DECODER_HEAD_DIMS or device.type == "cpu"
        fused = cls(launch, dtype, False, False, False)
        fused.norms = _tried(_probe_norms, fused, body, device, dtype)
        fused.rotary = built and _tried(_probe_rotary, fused, body, device, dtype)
        attends = head_dim in DECODER_HEAD_DIMS or (head_dim >= 32 and built)
        fused.attention = attends and _tried(_probe_attention, fused, body.layers[0], device, dtype)
        for layer in body.layers:
            router = getattr(layer.mlp, "gate", None)
            found = _tried(_probe_router, fused, router, device, dtype)
            if found:
                fused.routers[router] = functools.partial(_fused_router, fused, router, *found)
        return fused

    # -- the kernels, by their registered names ---------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None) -> torch.Tensor:
        """Llama's RMSNorm of `x [R, W]` (of `residual` after `residual += x`, in place, when given)."""
        out = torch.empty_like(x)
        add = residual is not None
        name = f"{'add_' if add else ''}rms_norm_{self.suffix}"
        self.launch(name, (x.shape[0],), x, residual if add else x, weight, out, x.shape[1], eps)
        return out

    def rope_kv_write(self, q, k, v, tables, position, keys, values, norms, eps) -> torch.Tensor:
        """The rotated q `[heads, D]`; k rotated and v written into `keys`/`values` at `position`."""
        (heads, head_dim), kv_heads = q.shape, k.shape[0]
        q_out = torch.empty_like(q)
        name = f"rope_kv_write{'_qk_norm' if norms else ''}_d{head_dim}_{self.suffix}"
        q_norm, k_norm = norms or (q, k)  # unread without the norms
        cos, sin = tables
        args = (q, k, v, q_norm, k_norm, cos, sin, position, q_out, keys, values)
        self.launch(name, (heads + kv_heads,), *args, heads, kv_heads, keys.shape[2], cos.shape[0], eps)
        return q_out

    def attend(self, q: torch.Tensor, keys, values, position, scaling: float) -> torch.Tensor:
        """`[heads, D]`: one query's attention over positions 0 … position of the buffers."""
        (heads, head_dim), (_, kv_heads, capacity, _) = q.shape, keys.shape
        splits, split_len = attention_splits(capacity)
        partial = torch.empty((heads, splits, head_dim), dtype=torch.float32, device=q.device)
        maxes = torch.empty((heads, splits), dtype=torch.float32, device=q.device)
        sums, out, group = torch.empty_like(maxes), torch.empty_like(q), heads // kv_heads
        grid = (kv_heads * -(-group // ATTENTION_BLOCK_H), splits)
        suffix = f"d{head_dim}_{self.suffix}"
        args = (q, keys, values, position, partial, maxes, sums, group, capacity, split_len, splits, scaling)
        self.launch(f"decode_attention_split_{suffix}", grid, *args)
        self.launch(f"decode_attention_reduce_{suffix}", (heads,), partial, maxes, sums, out, splits)
        return out

    def top_k(self, logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype) -> tuple:
        """`(ids [T, K], weights [T, K])` of router `logits [T, E]` (softmax, top-k, renormalized)."""
        tokens, experts = logits.shape
        ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
        weights = torch.empty((tokens, top_k), dtype=dtype, device=logits.device)
        name = f"router_top_k_{self.suffix}"
        self.launch(name, (tokens,), logits, ids, weights, experts, top_k, int(renormalize))
        return ids, weights


def epsilon(norm: nn.Module) -> float | None:
    """A norm module's epsilon (`variance_epsilon` or `eps`), None where it has no float one."""
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) else None


def _agrees(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to rounding: float32 to 1e-5 of the largest value, bfloat16 to two of its steps."""
    tolerance = 1e-5 if want.dtype == torch.float32 else 2**-6
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    return (got.float() - want.float()).abs().max().item() <= tolerance * want.float().abs().max().item()


def _probe(width: int, rows: int, device, dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn((rows, width), generator=generator) * 3).to(device=device, dtype=dtype)


def _norm_agrees(fused: FusedDecoder, norm: nn.Module, device, dtype) -> bool:
    weight, eps = getattr(norm, "weight", None), epsilon(norm)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or eps is None or weight.dtype != dtype:
        return False
    x = _probe(weight.numel(), 4, device, dtype, 0)
    with torch.inference_mode():
        return _agrees(fused.rms_norm(x, weight, eps), norm(x))


def _tried(probe: Callable, *args):
    """`probe(*args)`, or False where its kernels cannot run here (a cubin that does not load: the
    piece stays with the modules; the reason logged)."""
    try:
        return probe(*args)
    except (RuntimeError, OSError, KeyError, ValueError) as err:
        log.info("A fused decoder kernel does not run here (%s): %s", probe.__name__, err)
        return False


def _probe_attention(fused: FusedDecoder, layer, device, dtype) -> bool:
    """Whether `decode_attention` gives scaled dot-product attention's output on a probe cache."""
    heads, kv_heads, capacity, head_dim = 4, 2, 200, layer.head_dim
    q = _probe(head_dim, heads, device, dtype, 5)
    keys, values = (
        _probe(head_dim, kv_heads * capacity, device, dtype, s).view(1, kv_heads, capacity, -1)
        for s in (6, 7)
    )
    position = torch.tensor([150], device=device)
    mask = (torch.arange(capacity, device=device) <= position)[None, None, None, :]
    with torch.inference_mode():
        got = fused.attend(q, keys, values, position, layer.scaling)
        want = F.scaled_dot_product_attention(
            q[None, :, None], keys, values, attn_mask=mask, scale=layer.scaling, enable_gqa=True
        )
    return _agrees(got, want[0, :, 0])


def _probe_norms(fused: FusedDecoder, body, device, dtype) -> bool:
    norms = [n for layer in body.layers for n in (layer.input_norm, layer.post_norm)] + [body.norm]
    return all(_norm_agrees(fused, norm, device, dtype) for norm in norms)


def _probe_rotary(fused: FusedDecoder, body, device, dtype) -> bool:
    """Whether `rope_kv_write` gives the family's rotation (and per-head q/k norms) of a probe."""
    layer = body.layers[0]
    norms = layer.q_norm, layer.k_norm
    per_head = [n.norm is not None and n.per_head for n in norms]
    if any(n.norm is not None for n in norms) and not all(per_head):
        return False  # a norm over the whole projection: the modules compute the rotary
    heads, kv_heads, head_dim = 4, 2, layer.head_dim
    q, k, v = (_probe(head_dim, n, device, dtype, s) for n, s in ((heads, 1), (kv_heads, 2), (kv_heads, 3)))
    tables = body.rotary.table(torch.empty(0, dtype=dtype, device=device), 8)
    if tables is None:
        return False
    cos, sin = (t[0] for t in tables)
    keys = torch.zeros((1, kv_heads, 8, head_dim), dtype=dtype, device=device)
    values, position = torch.zeros_like(keys), torch.tensor([5], device=device)
    weights, eps = qk_norm_weights(layer)
    with torch.inference_mode():
        rotated = fused.rope_kv_write(q, k, v, (cos, sin), position, keys, values, weights, eps)
        view = (1, 1, -1, head_dim)  # as the step views one token's projection per head
        want_q, want_k = (norm(x[None], view).transpose(1, 2) for norm, x in zip(norms, (q, k), strict=True))
        want_q, want_k = body.apply_rotary(want_q, want_k, cos[5][None, None], sin[5][None, None])
    wrote_v = torch.equal(values[0, :, 5], v)
    return _agrees(rotated, want_q[0, :, 0]) and _agrees(keys[0, :, 5], want_k[0, :, 0]) and wrote_v


def qk_norm_weights(layer) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, float]:
    """The per-head q and k norms' weights and epsilon `rope_kv_write` applies (None, 0: none)."""
    if layer.q_norm.norm is None:
        return None, 0.0
    return (layer.q_norm.norm.weight, layer.k_norm.norm.weight), epsilon(layer.q_norm.norm)


def _probe_router(fused: FusedDecoder, router, device, dtype) -> tuple[bool, torch.dtype] | None:
    """`(renormalize, the routing weights' dtype)` where `_fused_router` gives `router`'s logits,
    routing weights and ids on a probe; else None."""
    weight, top_k = getattr(router, "weight", None), getattr(router, "top_k", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or not isinstance(top_k, int):
        return None
    if weight.shape[0] > ROUTER_BLOCK_E or top_k > ROUTER_MAX_K or getattr(router, "bias", None) is not None:
        return None
    x = _probe(weight.shape[1], 4, device, dtype, 4)
    with torch.inference_mode():
        try:
            want = router.forward(x)
        except Exception:  # another signature: not a plain top-k router
            return None
        if not isinstance(want, tuple) or len(want) != 3:
            return None
        logits = F.linear(x, weight)
        probs = logits.float().softmax(dim=-1)
        for renormalize in (True, False):
            ids, weights = fused.top_k(logits, top_k, renormalize, want[1].dtype)
            # the same experts, but for the order of exactly tied ones (the kernel takes the lowest
            # first; torch's order of ties is its own): the same probabilities taken
            taken = torch.equal(probs.gather(-1, ids), probs.gather(-1, want[2]))
            if taken and _agrees(weights, want[1]) and _agrees(logits, want[0]):
                return renormalize, want[1].dtype
    return None


def _fused_router(fused: FusedDecoder, router, renormalize: bool, dtype: torch.dtype, hidden) -> tuple:
    """`router.forward` through `router_top_k`: (logits, routing weights, ids)."""
    logits = F.linear(hidden.reshape(-1, router.weight.shape[1]), router.weight)
    ids, weights = fused.top_k(logits, router.top_k, renormalize, dtype)
    return logits, weights, ids
