"""MoE execution: transformers' experts module replaced by one that reads the expert cache.

transformers' MoE block routes (its own router, so routing is exactly the model's) and calls
`experts(hidden, top_k_index, top_k_weights)`. The replacement runs in named stages, as vLLM's
modular fused-MoE layer does:

    route       the routes each expert serves (SS-MoE's top-r while self-drafting); the router's
                scores go to a score-based cache policy (MRS)
    plan        which misses the CPU computes (HybriMoE), the order the rest are brought in (hits
                first, so misses' copies overlap the hits' compute), whether the step streams,
                and the next layer's lookahead
    bring in    `pipeline.ready_experts`: slots pinned, copies issued, experts yielded as they land
    compute     each expert from its slot with the original module's activation (`_apply_gate`,
                `act_fn`, transposed or biased weights as the family has them)
    combine     weighted and added into the output, row by row

The layer's strategy is chosen once, when it is installed (`execute`): its experts through ggml
where they lie in the store (in place, `--kernels ggml`), else through the device cache (the
stages above). On CUDA a step whose experts serve few tokens each (decode, drafting, a verify)
brings them in and computes them in groups instead (`pipeline.ready_together`,
`engine.moe.batched_experts`): a few batched kernels a layer rather than a few an expert. With
every expert on the device (`ExpertCache.holds_all`), a one-token step skips route, plan and bring
in: its experts are looked up in the layer's slot table on the device
(`batched_experts.forward_resident`: through the fused kernels where they apply, `fused_experts`;
`cuda_graphs` replays it).

`ExpertControl` (engine.moe.control) is the one object every layer of a model shares: what a run
installs for its duration, always through `ExpertControl.installed`, which restores on exit —
observers (the prefetch predictors see each layer's hidden state and routes before its experts
run), the lookahead, CPU execution of misses and, while drafting, a `DraftRouting` (SS-MoE top-r
self-draft, optionally from cached experts only, or SubSpec's resident low-bit substitutes, which
never touch the cache). The router's logits of the latest forward are kept per layer
(engine.moe.routing_trace) for the cache policy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import closing
from dataclasses import dataclass

import torch
from torch import nn

from engine.device_cache.expert_cache import ExpertCache
from engine.device_cache.pipeline import ready_experts
from engine.errors import UnsupportedArchitectureError
from engine.formats import int_quant as quant
from engine.model.adapters.base import Architecture
from engine.model.hf_calls import decoder_of
from engine.moe.batched_experts import accumulate_in_groups, forward_resident, in_groups, resident_asked
from engine.moe.control import DraftRouting, ExpertControl
from engine.moe.fused_experts import FusedExperts
from engine.moe.ggml_routes import InPlaceGgml
from engine.moe.routing_trace import RoutingTrace
from engine.store.host_store import ExpertStore


@dataclass(frozen=True)
class _Step:
    """One MoE layer call's tensors, shared by its experts' computations."""

    hidden: torch.Tensor  # [T, H]
    weights: torch.Tensor  # [T*K] routing weights, flat
    top_k: int
    out: torch.Tensor  # [T, H]
    routes: dict[int, list[int]]  # expert -> its flat [T*K] positions
    index: list[list[int]]  # [T][K] the experts each token is routed to


@dataclass(frozen=True)
class _Plan:
    """Where each routed expert of one step is computed, and in what order it is brought in."""

    on_cpu: list[int]  # misses the CPU computes from the host store (no copy)
    on_device: list[int]  # acquire order
    streaming: bool
    lookahead: Callable[[], list[tuple[int, int]]] | None  # the next layer's experts, once issued


def group_by_expert(index: list[list[int]]) -> dict[int, list[int]]:
    """Expert -> its flat positions `t·K + k` in the `[T][K]` routes."""
    routes: dict[int, list[int]] = {}
    for position, expert in enumerate(e for token in index for e in token):
        routes.setdefault(expert, []).append(position)
    return routes


class OffloadedExperts(InPlaceGgml, nn.Module):
    """Drop-in for a transformers fused experts module, backed by the expert cache."""

    def __init__(
        self,
        original: nn.Module,
        layer: int,
        cache: ExpertCache,
        trace: RoutingTrace,
        control: ExpertControl,
    ):
        super().__init__()
        # The original (weights on the meta device) supplies the activation and layout flags;
        # kept out of the module tree so it is never moved or saved.
        self.__dict__["template"] = original
        self.layer = layer
        self.num_experts = original.num_experts
        self.cache = cache
        self.trace = trace
        self.control = control
        self.has_gate = getattr(original, "has_gate", True)
        self.has_bias = getattr(original, "has_bias", False)
        self.is_transposed = getattr(original, "is_transposed", False)
        # Llama 4 (engine.model.adapters.rewrites): the routing weight scales the expert's input
        self.scales_input = getattr(original, "scales_input", False)
        if getattr(original, "has_post_expert_norm", False):
            raise UnsupportedArchitectureError(
                f"{type(original).__name__}: a norm after each expert is not supported."
            )
        # the layer's execution strategy, chosen once here: its experts through ggml where they lie
        # in the store (in place, `--kernels ggml`: the store never changes), else through the
        # device cache; a SubSpec draft's substitutes stand in for either while it drafts
        self.execute = self._in_place_ggml if self.grouped_in_ggml else self._through_cache

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        control = self.control
        if control.pieces is None:  # graph pieces call the predictors between pieces
            for observe in control.observers:  # predictors start prefetches before this layer computes
                observe(self.layer, hidden_states, top_k_index)
        draft = control.draft
        if draft is not None and draft.substitute is not None:
            return self._forward_substitute(hidden_states, top_k_index, top_k_weights, draft.substitute)
        return self.execute(hidden_states, top_k_index, top_k_weights, draft)

    def _in_place_ggml(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, draft
    ) -> torch.Tensor:
        """Every expert lies in the store: nothing to plan or bring in; ggml computes the routes."""
        index, weights = self._routes(top_k_index, top_k_weights, draft)
        self.cache.use_in_place([(self.layer, {e for token in index for e in token})])
        return self._routed_in_ggml(hidden, weights, index)

    def _through_cache(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, draft
    ) -> torch.Tensor:
        """The experts from the device cache: a one-token target step over a cache holding every
        expert, or any step of a captured graph, looks them up in the layer's slot table on the
        device (a captured draft step cuts its routes to top-r there first; graph pieces bring
        them in); any other routes, plans, brings its experts in and computes them (in groups
        where the step allows)."""
        if draft is not None and self.control.graphed:  # a captured draft step: its top-r cut here
            top_k_index, top_k_weights = self._draft_routes(top_k_index, top_k_weights, draft)
            draft = None
        pieces = self.control.pieces
        if pieces is not None and draft is None:  # a step in graph pieces
            return pieces.experts(self, hidden, top_k_index, top_k_weights)
        table = self._slot_table(hidden, draft)
        if table is not None:  # every expert on the device: the host never reads the routing
            if self.control.counts_hits:
                self.cache.count_hits(top_k_index.numel())
            graphs = self.control.graphs
            compute = forward_resident if graphs is None else graphs.forward
            return compute(self, hidden, top_k_index, top_k_weights, table)
        step = self._route(hidden, top_k_index, top_k_weights, draft)
        plan = self._plan(step, drafting=draft is not None)
        for expert in plan.on_cpu:
            self._compute_on_cpu(step.routes[expert], expert, step)
        if in_groups(self, step, plan.on_device, plan.streaming):
            accumulate_in_groups(self, step, plan.on_device)
            return step.out
        experts = ready_experts(
            self.cache, self.layer, plan.on_device, streaming=plan.streaming, lookahead=plan.lookahead
        )
        with closing(experts):  # an error mid-layer releases every slot still pinned
            for expert, weights in experts:
                self._accumulate(step.routes[expert], weights, step)
        return step.out

    def _slot_table(self, hidden: torch.Tensor, draft: DraftRouting | None) -> torch.Tensor | None:
        """The layer's `ExpertCache.slot_table`, for a one-token target step computed in groups or
        by the fused kernels (`resident_asked`), or any target step of a captured graph."""
        through_table = hidden.shape[0] == 1 or self.control.graphed
        if not through_table or draft is not None or not self.cache.holds_all or not resident_asked(self):
            return None
        return self.cache.slot_table(self.layer)

    def _routes(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, draft: DraftRouting | None
    ) -> tuple[list[list[int]], torch.Tensor]:
        """`[T][K]` experts (the layer's one host synchronisation) and their `[T, K]` weights, after a
        draft's top-r cut; a score-based cache policy sees the router's scores."""
        if draft is not None and draft.top_r is not None:
            top_k_index, top_k_weights = self._draft_routes(top_k_index, top_k_weights, draft)
        if self.cache.policy.uses_scores and self.layer in self.trace.logits:
            scores = self.trace.logits[self.layer].float().softmax(dim=-1).mean(dim=0)  # [E]
            self.cache.policy.observe_scores(self.layer, scores.tolist())
        return top_k_index.tolist(), top_k_weights

    def _route(self, hidden: torch.Tensor, top_k_index, top_k_weights, draft: DraftRouting | None) -> _Step:
        """The routes each expert serves."""
        index, weights = self._routes(top_k_index, top_k_weights, draft)
        out = torch.zeros_like(hidden)  # [T, H]
        top_k = len(index[0]) if index else 0
        return _Step(hidden, weights.reshape(-1), top_k, out, group_by_expert(index), index)

    def _plan(self, step: _Step, drafting: bool) -> _Plan:
        """CPU misses first (HybriMoE's cost model, target steps only); then hits before misses,
        streamed hits (prefetched into transient slots) first among them to free their slots
        early, busy experts first within each group."""
        routes = dict(step.routes)
        hybrid = self.control.hybrid
        on_cpu = list(hybrid.cpu_experts(self.layer, routes)) if hybrid is not None and not drafting else []
        for expert in on_cpu:
            routes.pop(expert)
        order = sorted(routes, key=lambda e: (self._rank(e), -len(routes[e])))
        streaming = self.cache.streams(len(order), self.layer)
        target_streams = streaming and not drafting  # a verify or prefill, not a self-draft
        if target_streams:
            self.cache.expire_prefetches(self.layer, routes)
        lookahead = (lambda: self._ahead(step.hidden)) if target_streams else None
        return _Plan(on_cpu, order, streaming, lookahead)

    def _rank(self, expert: int) -> int:
        """Acquire order: streamed hits (a transient prefetch), other hits, misses."""
        key = (self.layer, expert)
        return 2 if key not in self.cache else 1 - self.cache.streamed(key)

    def _ahead(self, hidden: torch.Tensor) -> list[tuple[int, int]]:
        """The next MoE layer's experts predicted from this layer's input, likeliest first, that
        are not cached: streamed into transient slots while this layer finishes (`lookahead`)."""
        lookahead = self.control.lookahead
        if lookahead is None:
            return []
        return [key for key in lookahead(self.layer, hidden) if key not in self.cache]

    def _accumulate(self, positions: list[int], weights: dict[str, torch.Tensor], step: _Step) -> None:
        """One expert on the tokens routed to it, weighted and added into the output."""
        if len(positions) == 1:  # decode: one token, plain slices instead of gathers
            pos = positions[0]
            token = pos // step.top_k
            # [1, 1] weight: promotes as transformers does
            y = self._weighted(step.hidden[token : token + 1], step.weights[pos : pos + 1, None], weights)
            step.out[token : token + 1] += y.to(step.out.dtype)
        else:
            flat = torch.tensor(positions, device=step.hidden.device)
            token_idx = flat // step.top_k
            y = self._weighted(step.hidden[token_idx], step.weights[flat, None], weights)
            # index_put_ rather than index_add_: no thread-pool round trip for a few rows.
            step.out.index_put_((token_idx,), y.to(step.out.dtype), accumulate=True)

    @functools.cached_property
    def fused(self) -> FusedExperts | None:
        """The fused kernels computing this layer's one-token steps over a cache holding every
        expert (`engine.moe.fused_experts`), or None: decided once, at its first such step."""
        return FusedExperts.of(self)

    def _compute_on_cpu(self, positions: list[int], expert: int, step: _Step) -> None:
        """A missing expert computed on the CPU from the host store (Fiddler/HybriMoE): no copy."""
        flat = torch.tensor(positions, device=step.hidden.device)
        token_idx = flat // step.top_k
        x, scale = step.hidden[token_idx].to("cpu"), step.weights[flat, None].to("cpu")
        y = self._weighted(x, scale, self.cache.store.views(self.layer, expert)).to(step.hidden.device)
        step.out.index_put_((token_idx,), y.to(step.out.dtype), accumulate=True)
        self.cache.count_cpu_use()

    def _forward_substitute(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, store: ExpertStore
    ) -> torch.Tensor:
        """SubSpec drafting: every expert from its resident low-bit copy; the cache is not touched."""
        index = top_k_index.tolist()
        step = _Step(
            hidden,
            top_k_weights.reshape(-1),
            top_k_index.shape[-1],
            torch.zeros_like(hidden),
            group_by_expert(index),
            index,
        )
        for expert, positions in step.routes.items():
            self._accumulate(positions, store.views(self.layer, expert), step)
        return step.out

    def _draft_routes(
        self, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, draft: DraftRouting
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """SS-MoE self-draft routes: each token's r best experts (r < k), weights rescaled to the
        top-k's total; with `cached_only`, the r best among those already on the device."""
        order = top_k_weights.argsort(dim=-1, descending=True)  # [T, K]
        index, weights = top_k_index.gather(-1, order), top_k_weights.gather(-1, order)
        r = min(draft.top_r, index.shape[-1])
        if draft.cached_only:
            index, weights = self._cached_routes(index, weights, r)
        else:
            index, weights = index[:, :r], weights[:, :r]
        scale = top_k_weights.sum(-1, keepdim=True) / weights.sum(-1, keepdim=True).clamp_min(1e-9)
        return index, (weights * scale).to(top_k_weights.dtype)

    def _cached_routes(
        self, index: torch.Tensor, weights: torch.Tensor, r: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, the r best resident experts of its ranked top-k (its own best if none is)."""
        resident = {e for (layer, e) in self.cache.resident() if layer == self.layer}
        rows = []
        for experts in index.tolist():
            cached = [k for k, e in enumerate(experts) if e in resident][:r]
            rows.append(cached + [k for k in range(len(experts)) if k not in cached][: r - len(cached)])
        picks = torch.tensor(rows, device=index.device)  # [T, r] positions within the ranked top-k
        return index.gather(-1, picks), weights.gather(-1, picks)

    def _weighted(self, x: torch.Tensor, scale: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert's routed contribution: `scale · f(x)`, or `f(scale · x)` for a family whose
        routing weight scales the expert's input (`scales_input`)."""
        if self.scales_input:
            return self.expert_forward(x * scale, w)
        return self.expert_forward(x, w) * scale

    def expert_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert on its tokens `x [n, H]`, exactly as transformers' experts compute it."""
        up = quant.linear(x, w, "gate_up_proj" if self.has_gate else "up_proj", self.is_transposed)
        if self.has_bias:
            up = up + w["gate_up_proj_bias" if self.has_gate else "up_proj_bias"]
        act = self.template._apply_gate(up) if self.has_gate else self.template.act_fn(up)
        y = quant.linear(act, w, "down_proj", self.is_transposed)
        if self.has_bias:
            y = y + w["down_proj_bias"]
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"


def moe_blocks(model: nn.Module, arch: Architecture) -> dict[int, tuple[str, nn.Module]]:
    """Decoder layer index → (qualified name of the layer, its MoE block), for layers with routed experts."""
    blocks = {}
    decoder_layers = decoder_of(model).layers
    prefix = next(name for name, module in model.named_modules() if module is decoder_layers)
    for index, layer in enumerate(decoder_layers):
        block = getattr(layer, arch.moe_attr, None) if arch.moe_attr else layer
        if block is not None and hasattr(block, "experts"):
            blocks[index] = (f"{prefix}.{index}", block)
    return blocks
