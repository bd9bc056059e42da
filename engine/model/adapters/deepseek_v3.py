"""DeepSeek-V3 / R1 and the models sharing its code (Kimi-K2, Moonlight).

Router: sigmoid scores; expert choice uses scores + `e_score_correction_bias`
with group top-k (sum of each group's best two), the weights use the
uncorrected scores, optionally renormalised, times `routed_scaling_factor`.
Shared experts and the first dense layers are resident. The official FP8
checkpoints load as they are: routed experts stay FP8 with their 128×128 block
scales (engine.offload.fp8_store), the rest is dequantized once at load.
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="deepseek_v3",
    router_rule="sigmoid + correction bias → group top-k → renormalise → × routed_scaling_factor",
    layouts=(
        per_expert_layout("mlp.experts", "gate_proj", "up_proj", "down_proj"),
        fused_layout("mlp.experts"),
    ),
)
