"""MoE execution: transformers' experts module replaced by one that reads the expert cache.

transformers' MoE block routes (its own router, so routing is exactly the
model's) and calls `experts(hidden, top_k_index, top_k_weights)`. The
replacement groups tokens by expert, pins every needed expert's cache slot
(hits first, so misses' copies overlap the hits' compute), and computes each
expert from its slot with the original module's activation (`_apply_gate`,
`act_fn`, transposed or biased weights as the family has them).

The router's logits of the latest forward are kept per layer (`RoutingTrace`)
for the cache policy and, later, the expert predictors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import BudgetTooSmallError
from engine.expert_cache import ExpertCache, NoEvictableSlot
from engine.models.base import Architecture


class RoutingTrace:
    """The latest router logits of each MoE layer, `[T, E]`."""

    def __init__(self) -> None:
        self.logits: dict[int, torch.Tensor] = {}

    def hook(self, layer: int):
        def record(_module, _inputs, output):
            self.logits[layer] = output[0].detach()

        return record

    def clear(self) -> None:
        self.logits.clear()


@dataclass(frozen=True)
class _Step:
    """One MoE layer call's tensors, shared by its experts' computations."""

    hidden: torch.Tensor  # [T, H]
    weights: torch.Tensor  # [T*K] routing weights, flat
    top_k: int
    out: torch.Tensor  # [T, H]


def _group_by_expert(flat_experts: list[int]) -> dict[int, list[int]]:
    routes: dict[int, list[int]] = {}
    for position, expert in enumerate(flat_experts):
        routes.setdefault(expert, []).append(position)
    return routes


class OffloadedExperts(nn.Module):
    """Drop-in for a transformers fused experts module, backed by the expert cache."""

    def __init__(self, original: nn.Module, layer: int, cache: ExpertCache, trace: RoutingTrace):
        super().__init__()
        # The original (weights on the meta device) supplies the activation and layout flags;
        # kept out of the module tree so it is never moved or saved.
        self.__dict__["template"] = original
        self.layer = layer
        self.num_experts = original.num_experts
        self.cache = cache
        self.trace = trace
        self.has_gate = getattr(original, "has_gate", True)
        self.has_bias = getattr(original, "has_bias", False)
        self.is_transposed = getattr(original, "is_transposed", False)

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)  # [T, H]
        if self.cache.policy.uses_scores and self.layer in self.trace.logits:
            scores = self.trace.logits[self.layer].float().softmax(dim=-1).mean(dim=0)  # [E]
            self.cache.policy.observe_scores(self.layer, scores.tolist())
        routes = _group_by_expert(top_k_index.reshape(-1).tolist())  # expert -> flat [T*K] positions
        step = _Step(hidden_states, top_k_weights.reshape(-1), top_k_index.shape[-1], out)
        # Hits first (their compute overlaps the misses' copies); busy experts first within each.
        order = sorted(routes, key=lambda e: ((self.layer, e) not in self.cache, -len(routes[e])))
        pending: deque = deque()
        try:
            for expert in order:
                while True:
                    try:
                        pending.append((routes[expert], self.cache.acquire((self.layer, expert))))
                        break
                    except NoEvictableSlot:
                        if not pending:  # every slot is held by other work (prefetches in flight)
                            raise BudgetTooSmallError(
                                f"Every expert cache slot is busy; layer {self.layer} cannot load "
                                f"expert {expert}. Raise --expert-budget."
                            ) from None
                        # Every slot is pinned by this layer: compute the oldest to free one.
                        self._compute(*pending.popleft(), step)
            while pending:
                self._compute(*pending.popleft(), step)
        finally:
            for _, slot in pending:  # only after an error: never leave a slot pinned
                self.cache.release(slot)
        return out

    def _compute(self, positions: list[int], slot, step: _Step) -> None:
        """One expert on the tokens routed to it, weighted and added into the output."""
        try:
            weights = self.cache.wait(slot)
            if len(positions) == 1:  # decode: one token, plain slices instead of gathers
                pos = positions[0]
                token = pos // step.top_k
                y = self.expert_forward(step.hidden[token : token + 1], weights)
                y = y * step.weights[pos : pos + 1, None]  # [1, 1]: promotes as transformers does
                step.out[token : token + 1] += y.to(step.out.dtype)
            else:
                flat = torch.tensor(positions, device=step.hidden.device)
                token_idx = flat // step.top_k
                y = self.expert_forward(step.hidden[token_idx], weights) * step.weights[flat, None]
                # index_put_ rather than index_add_: no thread-pool round trip for a few rows.
                step.out.index_put_((token_idx,), y.to(step.out.dtype), accumulate=True)
        finally:
            self.cache.release(slot)

    def expert_forward(self, x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """One expert on its tokens `x [n, H]`, exactly as transformers' experts compute it."""
        up = self._linear(x, w["gate_up_proj"] if self.has_gate else w["up_proj"])
        if self.has_bias:
            up = up + w["gate_up_proj_bias" if self.has_gate else "up_proj_bias"]
        act = self.template._apply_gate(up) if self.has_gate else self.template.act_fn(up)
        y = self._linear(act, w["down_proj"])
        if self.has_bias:
            y = y + w["down_proj_bias"]
        return y

    def _linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight if self.is_transposed else F.linear(x, weight)

    def extra_repr(self) -> str:
        return f"layer={self.layer}, num_experts={self.num_experts}, offloaded"


def expert_field_shapes(original: nn.Module) -> dict[str, tuple[int, ...]]:
    """Per-expert field shapes of a transformers fused experts module (its params are `[E, …]`)."""
    return {name: tuple(param.shape[1:]) for name, param in original.named_parameters(recurse=False)}


def moe_blocks(model: nn.Module, arch: Architecture) -> dict[int, tuple[str, nn.Module]]:
    """Decoder layer index → (qualified name of the layer, its MoE block), for layers with routed experts."""
    blocks = {}
    decoder_layers = model.get_decoder().layers
    prefix = next(name for name, module in model.named_modules() if module is decoder_layers)
    for index, layer in enumerate(decoder_layers):
        block = getattr(layer, arch.moe_attr, None)
        if block is not None and hasattr(block, "experts"):
            blocks[index] = (f"{prefix}.{index}", block)
    return blocks
