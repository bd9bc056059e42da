"""gpt-oss (openai/gpt-oss-20b, -120b).

Router: linear with bias → top-k on the logits → softmax over the chosen k.
Experts have biases, gate and up interleaved in one transposed `[H, 2I]`
matrix, and a clamped SwiGLU ((up + 1) · gate · σ(α · gate)); transformers'
module provides that activation and we reuse it. The official release stores
experts in MXFP4 (`*_blocks`/`*_scales`); they stay MXFP4 in the store, on the link
and in the device cache (engine.offload.mxfp4_store).
"""

from engine.model.adapters.base import Architecture, fused_layout

ARCHITECTURE = Architecture(
    model_type="gpt_oss",
    router_rule="linear + bias → top-k on logits → softmax over the chosen k",
    layouts=(fused_layout("mlp.experts", bias=True),),
    router_attr="router",
)
