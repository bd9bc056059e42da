"""OLMoE (allenai/OLMoE-1B-7B).

Router: softmax → top-k, without renormalisation unless `norm_topk_prob`.
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="olmoe",
    router_rule="softmax → top-k → optional renormalisation",
    layouts=(
        per_expert_layout("mlp.experts", "gate_proj", "up_proj", "down_proj"),
        fused_layout("mlp.experts"),
    ),
)
