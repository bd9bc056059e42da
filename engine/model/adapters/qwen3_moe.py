"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B).

Router: softmax over all experts → top-k → renormalise when `norm_topk_prob`.
No shared expert; `mlp_only_layers` / `decoder_sparse_step` may make some layers dense.
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="qwen3_moe",
    router_rule="softmax → top-k → optional renormalisation",
    layouts=(
        per_expert_layout("mlp.experts", "gate_proj", "up_proj", "down_proj"),
        fused_layout("mlp.experts"),
    ),
)
