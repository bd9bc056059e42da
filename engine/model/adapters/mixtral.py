"""Mixtral (Mixtral-8x7B, 8x22B).

Router: top-k over the gate logits, softmax over the chosen k. Original
checkpoints name experts `block_sparse_moe.experts.<e>.w1/w3/w2` (gate/up/down);
transformers 5 renames the block to `mlp` in memory.
"""

from engine.model.adapters.base import Architecture, fused_layout, per_expert_layout

ARCHITECTURE = Architecture(
    model_type="mixtral",
    router_rule="softmax → top-k → renormalise (softmax over the chosen k)",
    layouts=(
        per_expert_layout("block_sparse_moe.experts", "w1", "w3", "w2"),
        per_expert_layout("mlp.experts", "gate_proj", "up_proj", "down_proj"),
        fused_layout("mlp.experts"),
    ),
)
