"""Remote-code checkpoints read through the transformers family they derive from, running no code.

Kimi-K2 (`model_type: kimi_k2`) and other DeepSeek-V3 derivatives publish a config whose
`auto_map` points at Python files in the repository (`configuration_deepseek.py`, …) that
transformers runs only with `trust_remote_code=True`. MoE Chat never runs a repository's code.
When such a config's `architectures` name a causal-LM class transformers ships
(`DeepseekV3ForCausalLM`) of a family the engine supports, its fields are read by that family's
own config class instead: the weights carry the family's names, so nothing else changes.

Contract: `base_model_type(raw)` gives the supported family a raw config.json reads as (its own
`model_type` when that is supported) or None; `derived_config(raw, base)` builds the family's
config from the raw fields. A remote-code tokenizer is refused with its reason by
`remote_code_tokenizer(folder)`, since running it is the one thing we do not do. transformers is
imported only for a remote-code config, so the GUI's model checks and Hub search stay light.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from engine.model.adapters import SUPPORTED_MODEL_TYPES

log = logging.getLogger(__name__)

# keys of a remote-code config that name its code, not the model
_CODE_KEYS = ("auto_map", "model_type")


def _family_of_class() -> dict[str, str]:
    """Causal-LM class name → the supported family whose class it is (`DeepseekV3ForCausalLM` →
    `deepseek_v3`); a class several types share maps to the first supported one."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found: dict[str, str] = {}
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type in SUPPORTED_MODEL_TYPES:
            found.setdefault(class_name, model_type)
    return found


def base_model_type(raw: dict) -> str | None:
    """The supported family `raw` (a config.json) is read as, or None when there is none."""
    model_type = raw.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    if not isinstance(raw.get("auto_map"), dict):
        return None  # not remote code: an unknown family stays unknown
    families = _family_of_class()
    architectures = raw.get("architectures") or ()
    return next((families[a] for a in architectures if isinstance(a, str) and a in families), None)


def derived_config(raw: dict, base: str):
    """`raw`'s fields read by `base`'s own config class (no `auto_map`: no code to run)."""
    from transformers import AutoConfig

    fields = {key: value for key, value in raw.items() if key not in _CODE_KEYS}
    log.info(
        "%r is remote code; reading it as transformers' %s (no code is run)", raw.get("model_type"), base
    )
    return AutoConfig.for_model(base, **fields)


def remote_code_tokenizer(folder: Path) -> str | None:
    """The tokenizer class a folder's tokenizer_config.json asks remote code for (`auto_map`),
    or None when its tokenizer is transformers' own."""
    path = folder / "tokenizer_config.json"
    try:
        settings = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    auto_map = settings.get("auto_map") if isinstance(settings, dict) else None
    if not isinstance(auto_map, dict) or "AutoTokenizer" not in auto_map:
        return None
    classes = auto_map["AutoTokenizer"]
    named = classes if isinstance(classes, list) else [classes]
    return next((str(c) for c in named if c), "a remote-code tokenizer")
