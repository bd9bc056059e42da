"""Tiny configs for every Mixture-of-Experts family transformers ships, shrunk generically.

Contract: `moe_model_types()` lists the `model_type`s of transformers' config registry whose
config (or its `text_config`) counts routed experts; `shrunk_config(model_type)` is that family's
default config with every size made tiny (2-3 layers, 64 wide, 8 experts, top-2, a byte-level
vocabulary), passed to the config's constructor so derived fields (layer types, head dims)
follow. A family whose config needs more than the generic shrink gets an entry in
`CONFIG_FIXES`, each named by the test that needs it (tests/engine/model/test_all_families.py).
"""

from __future__ import annotations

import logging

from transformers import AutoConfig, PretrainedConfig
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES
from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

from engine.model.adapters.generic import TOP_K_KEYS

log = logging.getLogger(__name__)

EXPERT_COUNT_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
VOCAB = 259  # 256 bytes and three ChatML specials (engine.tiny.models)
TEXT_CONFIG_KEYS = ("text_config", "language_config", "llm_config")

# key -> tiny value; a key is set only where the family's config has it.
_SIZES: dict[str, object] = {
    "hidden_size": 64,
    "intermediate_size": 48,  # dense layers (DeepSeek's first layers, shared MLPs)
    "intermediate_size_mlp": 48,  # Llama 4's dense layers
    "moe_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "vocab_size": VOCAB,
    "max_position_embeddings": 512,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "n_group": 4,
    "topk_group": 2,
    "first_k_dense_replace": 0,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "sliding_window": 8,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_num_heads": 4,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "n_groups": 1,
    "mamba_d_head": 16,
    "mamba_n_heads": 8,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "conv_L_cache": 3,
    "bos_token_id": None,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
# A multimodal config's vision tower, shrunk so its checkpoint is saved as published (the engine
# never reads it: a vision-language checkpoint loads its language model only).
VISION_CONFIG_KEY = "vision_config"
_VISION_SIZES: dict[str, object] = {
    "depth": 1,
    "num_hidden_layers": 1,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_heads": 2,
    "num_attention_heads": 2,
    "out_hidden_size": _SIZES["hidden_size"],  # the merger projects into the language model's width
    "deepstack_visual_indexes": [],
}
# Derived from the layer count by the constructor: left out so it derives them again.
_DERIVED = ("mlp_only_layers", "moe_layers")
INDEX_LIST_SUFFIXES = ("_idxs", "_indices")  # lists of layer indices, not one value per layer
MAX_LAYERS = 4

# Per-family settings the generic shrink cannot guess: model_type -> keys (test: test_all_families).
_GEMMA4_MOE = {"enable_moe_block": True, "num_experts": 8, "top_k_experts": 2, "moe_intermediate_size": 32}
CONFIG_FIXES: dict[str, dict[str, object]] = {
    "gemma4": _GEMMA4_MOE,  # its default config is dense: the MoE block is opt-in
    "gemma4_text": _GEMMA4_MOE,
    "hunyuan_v1_moe": {"num_experts": 8, "moe_topk": 2},
    # hybrids whose default pattern the shrink cannot cut: keep an attention layer beside the
    # recurrent ones (the cache measures its length on one) and an MoE layer beside a dense one
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"]},
    "jamba": {
        "num_hidden_layers": 4,  # mamba+dense, attention+MoE, mamba+dense, mamba+MoE
        "attn_layer_period": 4,
        "attn_layer_offset": 1,
        "expert_layer_period": 2,
        "expert_layer_offset": 1,
    },
    "lfm2_moe": {
        "num_hidden_layers": 3,  # its default derives layer_types from full_attn_idxs, which the shrink drops
        "num_dense_layers": 1,
        "layer_types": ["conv", "full_attention", "conv"],
    },
}


def _text_part(values: dict) -> dict:
    for key in TEXT_CONFIG_KEYS:
        if isinstance(values.get(key), dict):
            return values[key]
    return values


def expert_count(config: PretrainedConfig) -> int | None:
    """The number of routed experts a config declares (in its text part for multimodal ones)."""
    text = _text_part(config.to_dict())
    for key in EXPERT_COUNT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return None


def is_multimodal(model_type: str) -> bool:
    """Whether `model_type`'s checkpoints are published as a vision-language model, whose language
    model is what transformers' causal-LM class of the type builds."""
    return model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES


def moe_model_types() -> tuple[str, ...]:
    """Every `model_type` in transformers' registry whose default config has routed experts."""
    found = []
    for model_type in CONFIG_MAPPING_NAMES:
        if model_type in CONFIG_FIXES:
            found.append(model_type)
            continue
        try:
            config = CONFIG_MAPPING[model_type]()
        except Exception as err:  # a config that cannot build by default is no candidate
            log.debug("skipping %s: its default config does not build (%s)", model_type, err)
            continue
        if expert_count(config):
            found.append(model_type)
    return tuple(found)


def _layer_keep(defaults: dict) -> list[int] | None:
    """Which of the default config's layers to keep: the first of each kind (by every per-layer list,
    index list and per-layer override), at least two, at most `MAX_LAYERS`."""
    layers = defaults.get("num_hidden_layers")
    if not isinstance(layers, int):
        return None
    per_layer = [v for v in defaults.values() if isinstance(v, list | str) and len(v) == layers]
    indexed = [set(v) for k, v in defaults.items() if k.endswith(INDEX_LIST_SUFFIXES) and isinstance(v, list)]
    overrides = {int(k): str(v) for k, v in (defaults.get("per_layer_config") or {}).items()}
    keep, kinds = [], set()
    for index in range(layers):
        kind = (tuple(v[index] for v in per_layer), tuple(index in v for v in indexed), overrides.get(index))
        if kind not in kinds:
            kinds.add(kind)
            keep.append(index)
    keep = keep[:MAX_LAYERS]
    extra = [i for i in range(layers) if i not in keep]
    return sorted(keep + extra[: max(0, 2 - len(keep))])


def _select_layers(settings: dict, defaults: dict, keep: list[int]) -> None:
    layers = defaults["num_hidden_layers"]
    for key, value in defaults.items():
        if isinstance(value, list | str) and len(value) == layers and key not in _DERIVED:
            picked = [value[i] for i in keep]
            settings[key] = "".join(picked) if isinstance(value, str) else picked
        elif key.endswith(INDEX_LIST_SUFFIXES) and isinstance(value, list):
            settings[key] = [keep.index(i) for i in value if i in keep]
    if defaults.get("per_layer_config"):
        old = {int(k): v for k, v in defaults["per_layer_config"].items()}
        settings["per_layer_config"] = {new: old[i] for new, i in enumerate(keep) if i in old}
    settings["num_hidden_layers"] = len(keep)


def _shrunk(defaults: dict, fixes: dict) -> dict:
    settings = {key: value for key, value in defaults.items() if key not in _DERIVED}
    keep = _layer_keep(defaults)
    for key, value in _SIZES.items():
        if key in defaults:
            settings[key] = value
    for key in EXPERT_COUNT_KEYS:
        if isinstance(defaults.get(key), int):
            settings[key] = 8
    for key in TOP_K_KEYS:
        if isinstance(defaults.get(key), int):
            settings[key] = 2
    if "kv_lora_rank" in defaults:  # multi-head latent attention has no GQA
        settings["num_key_value_heads"] = settings.get("num_attention_heads", 4)
    if keep is not None:
        _select_layers(settings, defaults, keep)
    return {**settings, **fixes}


def shrunk_config(model_type: str, **overrides) -> PretrainedConfig:
    """`model_type`'s default config with tiny sizes; `overrides` win over everything."""
    defaults = CONFIG_MAPPING[model_type]().to_dict()
    settings = _shrunk(defaults, CONFIG_FIXES.get(model_type, {}))
    for key in TEXT_CONFIG_KEYS:
        if isinstance(defaults.get(key), dict):
            sub = defaults[key]
            settings[key] = _shrunk(sub, CONFIG_FIXES.get(sub.get("model_type", ""), {}))
    if isinstance(defaults.get(VISION_CONFIG_KEY), dict):
        vision = defaults[VISION_CONFIG_KEY]
        settings[VISION_CONFIG_KEY] = {**vision, **{k: v for k, v in _VISION_SIZES.items() if k in vision}}
    for key in ("model_type", "transformers_version", "architectures", "_name_or_path", "dtype"):
        settings.pop(key, None)
    config = AutoConfig.for_model(model_type, **{**settings, **overrides})
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    return config
