"""Granite-MoE (ibm-granite/granite-3.x-*-a*m).

Router: top-k on the logits → softmax over the chosen k. Checkpoints store each
layer's experts fused as `block_sparse_moe.input_linear.weight` `[E, 2I, H]`
(gate and up) and `output_linear.weight` `[E, H, I]`.
"""

from engine.model.adapters.base import Architecture, fused_layout

ARCHITECTURE = Architecture(
    model_type="granitemoe",
    router_rule="top-k on logits → softmax over the chosen k",
    layouts=(
        fused_layout("block_sparse_moe", gate_up="input_linear.weight", down="output_linear.weight"),
        fused_layout("block_sparse_moe.experts"),
    ),
    moe_attr="block_sparse_moe",
    router_attr="router",
)
