"""Phi-3.5-MoE (microsoft/Phi-3.5-MoE-instruct).

Router: sparsemixer — the top-2 experts are picked one after another with a
jitter-masked softmax; transformers' router module implements it. Checkpoints
use Mixtral's naming (`block_sparse_moe.experts.<e>.w1/w3/w2`, router `gate`).
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="phimoe",
    router_rule="sparsemixer top-2 (masked softmax per pick)",
    layouts=(
        per_expert_layout("block_sparse_moe.experts", "w1", "w3", "w2"),
        fused_layout("mlp.experts"),
    ),
    router_attr="router",
)
