"""What the generic adapter cannot read from a family's modules: one entry per `model_type`.

An entry sets `Architecture` fields (engine.model.adapters.base). Most entries only record the
router rule for logs and `--help` (transformers' router module computes it either way); an
entry that changes behaviour names the test that needs it.
"""

from __future__ import annotations

OVERRIDES: dict[str, dict[str, object]] = {
    "qwen3_moe": {"router_rule": "softmax → top-k → optional renormalisation"},
    "qwen2_moe": {"router_rule": "softmax → top-k (+ shared expert with sigmoid gate, resident)"},
    "mixtral": {"router_rule": "softmax → top-k → renormalise (softmax over the chosen k)"},
    "olmoe": {"router_rule": "softmax → top-k → optional renormalisation"},
    "deepseek_v2": {
        "router_rule": "softmax → (group-limited) top-k → × routed_scaling_factor (+ shared experts)"
    },
    "deepseek_v3": {
        "router_rule": "sigmoid + correction bias → group top-k → renormalise → × routed_scaling_factor",
        "notes": "Official FP8 checkpoints keep their routed experts in FP8 (engine.formats.fp8_experts).",
    },
    "gpt_oss": {
        "router_rule": "linear + bias → top-k on logits → softmax over the chosen k",
        "notes": "Clamped SwiGLU on interleaved gate/up; MXFP4 stays MXFP4 (engine.formats.mxfp4_experts).",
    },
    "phimoe": {"router_rule": "sparsemixer top-2 (masked softmax per pick)"},
    "granitemoe": {"router_rule": "top-k on logits → softmax over the chosen k"},
}
