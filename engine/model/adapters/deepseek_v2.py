"""DeepSeek-V2 / V2-Lite.

Router: softmax in fp32; `greedy` top-k, or `group_limited_greedy` (keep the
`topk_group` best of `n_group` expert groups by their best expert, then top-k
within them); weights scaled by `routed_scaling_factor`. Shared experts and the
first `first_k_dense_replace` dense layers are resident. Attention is MLA
(transformers' module, with its compressed KV).
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="deepseek_v2",
    router_rule="softmax → (group-limited) top-k → × routed_scaling_factor (+ shared experts, resident)",
    layouts=(
        per_expert_layout("mlp.experts", "gate_proj", "up_proj", "down_proj"),
        fused_layout("mlp.experts"),
    ),
)
