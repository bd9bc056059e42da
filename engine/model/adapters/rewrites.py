"""MoE blocks that are not on transformers' experts interface, rewritten onto it.

Llama 4's block (`Llama4TextMoe`) routes by scaling each expert's *input*: every expert runs on
`sigmoid(logit) · x`, the experts outside the token's top-k on a zero input (which a bias-free
SwiGLU maps to zero), and the outputs are summed unweighted. Its experts module is called as
`experts(hidden)` on the whole `[E·T, H]` batch, and its router returns `(scores, logits)`.

`rewrite_moe_blocks` replaces such a block, in a model built on the meta device, by one that
computes the same thing on the interface the engine offloads: a router returning
`(logits, top_k_weights, top_k_index)` and an experts module called `experts(hidden, top_k_index,
top_k_weights)` that says `scales_input` (engine.moe.layer then computes `f_e(w·x)`
instead of `w·f_e(x)`). The rewritten modules keep the original parameters under the same
names, so checkpoints load as published. Test: tests/engine/model/test_all_families.py (llama4).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from transformers.models.llama4.modeling_llama4 import Llama4Router, Llama4TextMoe


class TopKSigmoidRouter(nn.Module):
    """Llama 4's router: top-k on the logits, each pick weighted by the sigmoid of its logit."""

    def __init__(self, router: Llama4Router):
        super().__init__()
        self.weight = router.weight
        self.top_k = router.top_k
        self.num_experts = router.num_experts

    def forward(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(hidden, self.weight)  # [T, E]
        top_value, top_index = torch.topk(logits, self.top_k, dim=1)
        weights = torch.sigmoid(top_value.float()).to(logits.dtype)
        return logits, weights, top_index


class InputScaledExperts(nn.Module):
    """Llama 4's fused experts (`gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`) on the experts
    interface; each expert computes `down(act(gate(w·x)) · up(w·x))`."""

    has_gate, has_bias, is_transposed, scales_input = True, False, True, True

    def __init__(self, experts: nn.Module):
        super().__init__()
        self.gate_up_proj = experts.gate_up_proj
        self.down_proj = experts.down_proj
        self.num_experts = experts.num_experts
        self.act_fn = experts.act_fn

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return up * self.act_fn(gate)

    def forward(
        self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for expert in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == expert)
            x = hidden[token] * top_k_weights[token, slot, None]
            y = self._apply_gate(x @ self.gate_up_proj[expert]) @ self.down_proj[expert]
            out.index_add_(0, token, y.to(out.dtype))
        return out


class InputScaledMoe(nn.Module):
    """Llama 4's MoE block: the shared expert plus the routed experts on their scaled inputs."""

    def __init__(self, block: Llama4TextMoe):
        super().__init__()
        self.hidden_dim = block.hidden_dim
        self.router = TopKSigmoidRouter(block.router)
        self.experts = InputScaledExperts(block.experts)
        self.shared_expert = block.shared_expert

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden_states.reshape(-1, self.hidden_dim)
        logits, weights, index = self.router(hidden)
        out = self.shared_expert(hidden)
        out.add_(self.experts(hidden, index, weights))
        return out, logits


REWRITES: dict[type, type] = {Llama4TextMoe: InputScaledMoe}


def rewrite_moe_blocks(model: nn.Module) -> None:
    """Replace, in place, every MoE block of `model` that `REWRITES` names."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            rewrite = REWRITES.get(type(child))
            if rewrite is not None:
                setattr(parent, name, rewrite(child))
