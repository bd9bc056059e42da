"""A MoE block's routing and experts as nodes of a layer's ggml graph (`--kernels ggml`).

Contract: `RoutedMlp.of(block)` is None unless the block is a router and experts only (its only
children), the router a bias-free float32 matrix whose rule is softmax → top-k, with or without
renormalizing the chosen weights (asked of the router itself on a probe), and the experts SwiGLU
experts ggml computes where they lie in the store (`OffloadedExperts.grouped_in_ggml`). Then:

    nodes(ggml, context, bind, x, tokens) -> (out [H, T], chosen [K, T] I32, logits [E, T])
        router logits, softmax, top-k, the chosen weights (renormalized where the router does),
        every route through its expert (`mul_mat_id`, as llama.cpp's MoE FFN), weighted and
        summed in top-k order: the block's output for the normed rows `x [H, T]`
    takes() -> whether this step may route inside ggml: nothing watches the routes but the
        engine's routing trace (no hook on the block or experts, none on the router but the
        trace's; no predictor, draft or cache policy reading the scores)
    used(chosen, logits) -> the cache counts the step's experts as `OffloadedExperts` does in
        place, and the routing trace records the logits as its hook on the router does

This is llama.cpp's graph for the block (`build_moe_ffn`): the router's product is ggml's float32
product, its softmax and top-k ggml's, so the weights round differently from torch's (~1e-7
relative) and a near tie between two experts' scores may pick the other one, as llama.cpp would.
What it saves is the step's host round trip for the routes and the ~15 torch operators around it.
"""

from __future__ import annotations

import functools

import torch
from gguf import GGMLQuantizationType
from torch import nn

from engine.ggml import kernels as ggml_kernels
from engine.moe.layer import OffloadedExperts

_F32 = int(GGMLQuantizationType.F32)


class RoutedMlp:
    def __init__(self, block: nn.Module, router: nn.Module, experts: OffloadedExperts, normalizes: bool):
        self.block, self.router, self.experts, self.normalizes = block, router, experts, normalizes
        self.weight: torch.Tensor = router.weight  # [E, H]
        self.num_experts = self.weight.shape[0]
        self.top_k = int(router.top_k)
        self.store, gate_up, down = experts.ggml_fields
        self.fields = (gate_up, down)

    @classmethod
    def of(cls, block: nn.Module) -> RoutedMlp | None:
        children = dict(block.named_children())
        router, experts = children.get("gate"), children.get("experts")
        if set(children) != {"gate", "experts"} or not isinstance(experts, OffloadedExperts):
            return None
        if not experts.grouped_in_ggml or not experts.swiglu_in_ggml or experts.scales_input:
            return None
        weight = getattr(router, "weight", None)
        parameters = dict(router.named_parameters())
        if (
            not isinstance(weight, torch.Tensor)
            or parameters.keys() != {"weight"}
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or not weight.is_contiguous()
            or not isinstance(getattr(router, "top_k", None), int)
        ):
            return None
        store, gate_up, down = experts.ggml_fields
        if weight.shape[0] != store.shape[0] or weight.shape[1] != gate_up[3] or gate_up[2] != 2 * down[3]:
            return None
        for field in (gate_up, down):
            ggml_kernels.checked_field(store, field)
        normalizes = _normalizes(router)
        return None if normalizes is None else cls(block, router, experts, normalizes)

    def takes(self) -> bool:
        # written out, not as generators: a decode step asks each layer, with the caches cold
        block, router, experts = self.block, self.router, self.experts
        if block._forward_pre_hooks or block._forward_hooks or experts._forward_pre_hooks:
            return False
        if experts._forward_hooks or router._forward_pre_hooks:  # the router's own hooks: the trace's alone
            return False
        control = experts.control
        if control.observers or control.draft is not None or experts.cache.policy.uses_scores:
            return False
        record = experts.trace.record
        for hook in router._forward_hooks.values():
            if not isinstance(hook, functools.partial) or hook.func != record:
                return False
        return True

    def refusal(self) -> str:
        """Why `takes` refuses now ('' when it takes): asked once a step has left the graph."""
        block, router, experts = self.block, self.router, self.experts
        if (
            block._forward_pre_hooks
            or block._forward_hooks
            or experts._forward_pre_hooks
            or experts._forward_hooks
        ):
            return "a hook on the MoE block or its experts"
        control = experts.control
        if control.observers:
            return "a prefetch predictor watches the layer's inputs"
        if control.draft is not None:
            return "a draft's routing (top-r or substitutes)"
        if experts.cache.policy.uses_scores:
            return "the cache policy reads the router's scores"
        if router._forward_pre_hooks or not self.takes():
            return "a hook on the router other than the routing trace"
        return ""

    def nodes(self, ggml, context, bind, x: int, tokens: int) -> tuple[int, int, int]:
        experts, hidden = self.weight.shape
        top_k = self.top_k
        router = ggml.new_tensor_2d(context, _F32, hidden, experts)
        bind(router, self.weight)
        logits = ggml.mul_mat(context, router, x)  # [E, T]
        probs = ggml.soft_max(context, logits)
        chosen = ggml.argsort_top_k(context, probs, top_k)  # [K, T]: best first, as torch.topk
        weights = ggml.get_rows(context, ggml.reshape_3d(context, probs, 1, experts, tokens), chosen)
        if self.normalizes:
            flat = ggml.reshape_2d(context, weights, top_k, tokens)
            weights = ggml.reshape_3d(
                context, ggml.div(context, flat, ggml.sum_rows(context, flat)), 1, top_k, tokens
            )
        rows = ggml.reshape_3d(context, x, hidden, 1, tokens)  # every route of a token: one row
        routed = ggml_kernels.swiglu_nodes(ggml, context, bind, self.store, self.fields, rows, chosen)
        routed = ggml.mul(context, routed, weights)  # [H, K, T]
        row_bytes = hidden * 4  # float32 rows
        out = None
        for k in range(top_k):  # a token's routes summed in top-k order
            route = ggml.view_2d(context, routed, hidden, tokens, row_bytes * top_k, k * row_bytes)
            out = route if out is None else ggml.add(context, out, route)
        return out, chosen, logits

    def used(self, chosen: torch.Tensor, logits: torch.Tensor) -> None:
        record_routes((self,), [chosen.tolist()], logits[None], chosen.shape[0])


def record_routes(blocks: tuple[RoutedMlp, ...], routes: list, logits: torch.Tensor, last_rows: int) -> None:
    """The experts each block chose (`routes [L][T][K]` lists: block i's at i, the last block's in
    its first `last_rows`) counted as hits in its expert cache, in one hold of the cache's lock for
    all the blocks sharing it, and their router logits (`logits [L, T, E]`, alike) traced."""
    shared = one_cache(blocks)
    if shared is not None:
        record_shared(shared, routes, logits, last_rows)
        return
    routes[-1] = routes[-1][:last_rows]
    used = _distinct(routes)
    experts = [block.experts for block in blocks]
    caches: dict[int, tuple] = {}  # per expert cache: the cache and its (layer, experts)
    for index, e in enumerate(experts):
        caches.setdefault(id(e.cache), (e.cache, []))[1].append((e.layer, used[index]))
        rows = last_rows if index == len(blocks) - 1 else logits.shape[1]
        e.trace.record(e.layer, blocks[index].router, None, (logits[index, :rows],))
    for cache, uses in caches.values():
        cache.use_in_place(uses)


def one_cache(blocks: tuple[RoutedMlp, ...]) -> tuple | None:
    """The expert cache and routing trace all `blocks` share (one model's), with their layers;
    None where they do not share one."""
    experts = [block.experts for block in blocks]
    cache, trace = experts[0].cache, experts[0].trace
    if all(e.cache is cache and e.trace is trace for e in experts):
        return cache, trace, tuple(e.layer for e in experts)
    return None


def record_shared(shared: tuple, routes: list, logits: torch.Tensor, last_rows: int) -> None:
    """`record_routes` of blocks sharing one expert cache and trace (`one_cache`'s)."""
    cache, trace, layers = shared
    routes[-1] = routes[-1][:last_rows]
    cache.use_in_place(list(zip(layers, _distinct(routes), strict=True)))
    trace.record_layers(layers, logits, last_rows)


def _distinct(routes: list) -> list:
    """Each block's distinct experts of its `[T][K]` routes (a token's own list where it is one)."""
    return [rows[0] if len(rows) == 1 else {e for row in rows for e in row} for rows in routes]


def _normalizes(router: nn.Module) -> bool | None:
    """Whether `router` renormalizes its top-k softmax weights (True or False); None when it
    routes by another rule or returns something else than (logits, weights, experts)."""
    weight = router.weight
    probe = torch.randn((4, weight.shape[1]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = router.forward(probe)  # not its hooks: the routing trace would record the probe
        if not isinstance(out, tuple) or len(out) != 3:
            return None
        logits, weights, chosen = out
        if not torch.allclose(logits, probe @ weight.T, rtol=1e-5, atol=1e-6):
            return None
        top, wanted = torch.topk(torch.softmax(logits.float(), dim=-1), router.top_k, dim=-1)
        if not torch.equal(chosen, wanted):
            return None
        for normalizes, expected in ((True, top / top.sum(dim=-1, keepdim=True)), (False, top)):
            if torch.allclose(weights.float(), expected, rtol=1e-6, atol=0):
                return normalizes
    return None
