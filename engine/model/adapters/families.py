"""The MoE families of transformers' registry, as the generic adapter takes them (data only).

Regenerate-and-compare: tests/engine/model/test_all_families.py lists transformers' MoE families
again and fails when this table misses one, so a family transformers adds is never silently
dropped. `NOT_SUPPORTED` gives each refused family its reason.
"""

# ruff: noqa: E501 (one reason per line reads better than wrapped strings)
from __future__ import annotations

NO_CAUSAL_LM = "transformers has no causal-LM class for it (multimodal, encoder-decoder or encoder only)"

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "phimoe",
    "granitemoe",
    "afmoe",
    "aria_text",
    "axk2",
    "beam",
    "cohere2_moe",
    "deepseek_v32",
    "ernie4_5_moe",
    "exaone_moe",
    "flex_olmo",
    "gemma4",
    "gemma4_text",  # the language model of gemma4, which its checkpoints load as
    "glm4_moe",
    "glm4_moe_lite",
    "glm_moe_dsa",
    "granitemoe_swa",
    "granitemoehybrid",
    "granitemoeshared",
    "hunyuan_v1_moe",
    "hy_v3",
    "hy_v4",
    "inkling_text",
    "kolibri1",
    "laguna",
    "lfm2_moe",
    "llama4",  # its MoE block is rewritten onto the experts interface (engine.model.adapters.rewrites)
    "llama4_text",  # llama4's language model saved alone
    "mellum",
    "mimo_v2_flash",
    "minimax_m2",
    "minimax_m3_vl_text",
    "nemotron_h",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5_moe_text",  # qwen3_5_moe's language model saved alone (Qwen3_5MoeForCausalLM), as fine-tunes publish it
    "sarvam_mla",
    "solar_open",
)

# Exact in plain decoding, but speculative verification cannot rewind them yet: `auto` does not
# speculate on these, and an explicit drafter is refused with the reason.
NO_SPECULATION: dict[str, str] = {}

NOT_SUPPORTED: dict[str, str] = {
    "axk1": "not yet exact: its tiny config fails in transformers itself (MLA head sizes, modeling_axk1.py:361)",
    "bailing_hybrid": "not yet exact: the generic shrink gives a config whose checkpoint and model disagree (linear_attn.in_proj)",
    "deepseek_v4": "not yet exact: its per-expert names come from a regex renaming the generic adapter does not undo (ffn.experts)",
    "doge": "its experts are not on transformers' experts interface (a hand-written module would be needed)",
    "dots3_note": "not yet exact: the generic shrink breaks its validator (SWA head_dim = qk_nope + qk_rope)",
    "flint": "its experts are not on transformers' experts interface (a hand-written module would be needed)",
    "inkling2_loop_text": "not yet exact: the generic shrink misses its vocabulary key (200k-row embedding; negative tensor size on load)",
    "inkling2_text": "not yet exact: the generic shrink misses its vocabulary key (200k-row embedding; negative tensor size on load)",
    "jamba": "not yet exact: transformers' Jamba restarts its selective scan from a zero state on every multi-token forward after a prefix (modeling_jamba.py: mamba_selective_scan gets no initial state), so chunked prefill, prefix reuse and speculative verification would be wrong; only one-token steps continue its state",
    "jetmoe": "its experts are not on transformers' experts interface (mixture of attention heads; hand-written module needed)",
    "kimi_linear": "not yet exact: its per-expert names come from a regex renaming the generic adapter does not undo",
    "lara_mini": "not yet exact: the generic shrink gives a config whose checkpoint and model disagree",
    "longcat_flash": "its experts are not on transformers' experts interface (zero-computation experts); hand-written module needed",
    "minimax": "not yet exact: it needs its own cache class (MiniMaxCache), the engine builds a DynamicCache",
    "qwen4_exp": "not yet exact: the generic shrink leaves its linear-attention head sizes unset",
    "sarvam_moe": "not yet exact: its tiny config fails to load through the engine (see test_all_families)",
    "zaya": "not yet exact: transformers supports only top-1 routing for it; the generic shrink sets top-2",
    "aria": NO_CAUSAL_LM,
    "deepseek_ocr2": NO_CAUSAL_LM,
    "deepseek_ocr2_text": NO_CAUSAL_LM,
    "dots3_note_text": "the text part of dots3_note: checkpoints name dots3_note",
    "dots3_note_vision_encoder": NO_CAUSAL_LM,
    "ernie4_5_vl_moe": NO_CAUSAL_LM,
    "ernie4_5_vl_moe_text": NO_CAUSAL_LM,
    "glm4v_moe": NO_CAUSAL_LM,
    "glm4v_moe_text": NO_CAUSAL_LM,
    "glm5_next": NO_CAUSAL_LM,
    "glm5_next_text": NO_CAUSAL_LM,
    "hy_v4_vl": NO_CAUSAL_LM,
    "hy_v4_vl_text": NO_CAUSAL_LM,
    "inkling2": NO_CAUSAL_LM,
    "inkling2_loop": NO_CAUSAL_LM,
    "inkling_mm_model": NO_CAUSAL_LM,
    "kimi_k25": NO_CAUSAL_LM,
    "minimax_m3_vl": NO_CAUSAL_LM,
    "mistral4": NO_CAUSAL_LM,
    "mistral_large4": NO_CAUSAL_LM,
    "mistral_large4_text": NO_CAUSAL_LM,
    "muse_spark": NO_CAUSAL_LM,
    "muse_spark_text": NO_CAUSAL_LM,
    "nemo_speechlm": NO_CAUSAL_LM,
    "nemotron_h_omni": NO_CAUSAL_LM,
    "nllb-moe": NO_CAUSAL_LM,
    "openai_privacy_filter": NO_CAUSAL_LM,
    "qwen3_omni_moe_talker_text": NO_CAUSAL_LM,
    "qwen3_omni_moe_text": NO_CAUSAL_LM,
    "qwen3_omni_moe_thinker": NO_CAUSAL_LM,
    "qwen3_vl_moe": NO_CAUSAL_LM,
    "qwen3_vl_moe_text": NO_CAUSAL_LM,
    "qwen4_exp_text": "the text part of qwen4_exp: checkpoints name qwen4_exp",
    "step3p5": NO_CAUSAL_LM,
    "step3p7": NO_CAUSAL_LM,
    "switch_transformers": NO_CAUSAL_LM,
    "unlimited_ocr": NO_CAUSAL_LM,
    "unlimited_ocr_text": NO_CAUSAL_LM,
}
