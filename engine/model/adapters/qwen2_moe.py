"""Qwen1.5-MoE / Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B).

Router: softmax → top-k → optional renormalisation. Every MoE layer also has a
shared expert whose output is scaled by sigmoid(shared_expert_gate(x)); it is a
plain resident MLP here.
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="qwen2_moe",
    router_rule="softmax → top-k (+ shared expert with sigmoid gate, resident)",
    layouts=(
        per_expert_layout("mlp.experts", "gate_proj", "up_proj", "down_proj"),
        fused_layout("mlp.experts"),
    ),
)
