"""The supported families whose decoder is the standard pre-norm one with full attention
(engine.decode.lean.standard_refusal): their one-token steps go through engine.decode.lean, and
their CUDA graph through the standard body with the fused decoder kernels. The others decode
through transformers' forward (and their graph holds their own modules)."""

STANDARD_FAMILIES = {
    "aria_text",
    "ernie4_5_moe",
    "glm4_moe",
    "hy_v3",
    "minimax_m2",
    "minimax_m3_vl_text",
    "mixtral",
    "olmoe",
    "phimoe",
    "qwen2_moe",
    "qwen3_moe",
    "solar_open",
}
