"""What a model folder holds: its config, its weights (safetensors or GGUF) and its tokenizer.

`open_checkpoint` is the one place that decides how a model on disk is read: a GGUF file
(or split set, or a folder holding one) through `GgufCheckpoint`, else a Hugging Face
folder through `Checkpoint` (a multimodal one as its language model only). Every problem
is an `EngineError` that says what to do.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import PrefixChange, WeightRenaming

from engine.errors import InvalidConfigError, ModelNotFoundError, UnsupportedArchitectureError
from engine.model.adapters import get_architecture
from engine.model.checkpoint import Checkpoint
from engine.model.derived_config import base_model_type, derived_config, remote_code_tokenizer
from engine.model.gguf_file import GgufCheckpoint, find_gguf

log = logging.getLogger(__name__)

# pre-quantized experts the engine keeps in their own format
KEPT_QUANTIZATION = ("mxfp4", "fp8", "gptq", "awq", "compressed-tensors")


def open_checkpoint(folder: Path) -> tuple[object, Checkpoint | GgufCheckpoint]:
    """The model's config and its weights: a GGUF file (or split set, or a folder holding one),
    else a Hugging Face folder of safetensors."""
    parts = find_gguf(folder)
    if parts is not None:
        gguf = GgufCheckpoint(parts)
        return gguf.hf_config(), gguf
    hf_config = read_config(folder)
    _reject_quantized(hf_config)
    return language_model_only(hf_config, Checkpoint(folder))


def language_model_only(hf_config, checkpoint):
    """A checkpoint seen as the causal LM of its language model, under that module's names.

    A multimodal one (`Qwen3_5MoeForConditionalGeneration` …): `model.language_model.layers…` →
    `model.layers…`, the prefix changes of transformers' conversion mapping; its vision tower's
    tensors match no parameter of the causal LM, so they are never read. Where transformers' causal
    LM of the type is the multimodal model itself (Gemma 4), the config becomes its text config
    (`Gemma4ForCausalLM`). A base model published under another name (Nemotron-H's `backbone.`)
    is read under the causal LM's (`model.`), a causal LM published inside its base-model prefix
    (Llama 4's `language_model.`) without it."""
    if not isinstance(checkpoint, Checkpoint):
        return hf_config, checkpoint
    renamings = []
    with torch.device("meta"):  # only for its module names and conversion mapping: no memory
        language_model = AutoModelForCausalLM.from_config(hf_config)
        if language_model.get_decoder() is not language_model.base_model:  # a multimodal wrapper
            renamings.append(_decoder_prefix_change(language_model))
            hf_config = _text_config(hf_config)
            language_model = AutoModelForCausalLM.from_config(hf_config)
    base_prefix = f"{language_model.base_model_prefix}."
    renamings += [
        t
        for t in get_model_conversion_mapping(language_model)
        if (isinstance(t, PrefixChange) and t.prefix_to_remove)
        or (isinstance(t, WeightRenaming) and t.target_patterns == [base_prefix])
    ]
    checkpoint.rename(renamings + _base_prefix_removal(language_model, checkpoint))
    return hf_config, checkpoint


def _base_prefix_removal(language_model, checkpoint: Checkpoint) -> list[PrefixChange]:
    """A causal LM published inside its `base_model_prefix` that names no attribute of it (Llama 4's
    `language_model.model.…`, read by `Llama4ForCausalLM` as `model.…`): that prefix removed."""
    prefix = language_model.base_model_prefix
    if not prefix or hasattr(language_model, prefix):
        return []
    published = [f"{prefix}.{child}." for child, _ in language_model.named_children()]
    if any(name.startswith(tuple(published)) for name in checkpoint):
        return [PrefixChange(prefix_to_remove=prefix)]
    return []


def _decoder_prefix_change(multimodal) -> PrefixChange:
    """`model.language_model.x` → `model.x`: the multimodal model's language model under the name
    its causal LM gives it."""
    decoder = multimodal.get_decoder()
    path = next(name for name, module in multimodal.named_modules() if module is decoder)
    parent, _, name = path.rpartition(".")
    return PrefixChange(prefix_to_remove=name, model_prefix=parent or None)


def _text_config(hf_config):
    """The language model's config, keeping the checkpoint's quantization (read from the top)."""
    text = hf_config.get_text_config()
    quant = getattr(hf_config, "quantization_config", None)
    if quant is not None and getattr(text, "quantization_config", None) is None:
        text.quantization_config = quant
    return text


def read_config(folder: Path):
    if not folder.exists():
        raise ModelNotFoundError(
            f"Model folder not found: {folder}. Check the path, or download the model first."
        )
    if not folder.is_dir():
        raise ModelNotFoundError(f"{folder} is a file; give the model's folder.")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise InvalidConfigError(
            f"{folder} has no config.json; it is not a Hugging Face model folder. "
            "Give the folder that holds config.json and the *.safetensors weights."
        )
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidConfigError(f"{config_path} is not valid JSON ({err}). Re-download the model.") from err
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise InvalidConfigError(
            f"{config_path} has no model_type; it is not a transformers model config. "
            "Re-download the model's config.json."
        )
    base = base_model_type(raw)
    get_architecture(base or raw["model_type"])  # unsupported types fail here with the list of supported ones
    try:
        if base != raw["model_type"]:  # remote code (Kimi-K2): read as the family it derives from
            return derived_config(raw, base)
        return AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError, OSError) as err:
        raise InvalidConfigError(f"{config_path} cannot be read by transformers: {err}") from err


def _reject_quantized(hf_config) -> None:
    quant = getattr(hf_config, "quantization_config", None)
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else type(quant).__name__
        refused = get_architecture(hf_config.model_type).unsupported_quantization
        if method in KEPT_QUANTIZATION and method not in refused:
            return  # its experts are loaded as they are (engine.formats.registry)
        raise UnsupportedArchitectureError(
            f"This checkpoint is pre-quantized ({method}); MoE Chat loads BF16/FP16/FP32 weights. "
            "Use the model's BF16 release."
        )


def load_tokenizer(folder: Path):
    """The model's tokenizer, or None when the folder has none (token ids still work)."""
    remote = remote_code_tokenizer(folder)
    has_files = any((folder / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))
    if not has_files:
        why = f"its tokenizer is remote code ({remote}), which MoE Chat does not run" if remote else "none"
        log.warning("%s has no tokenizer files (%s); only token-id prompts will work.", folder, why)
        return None
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        if remote:
            raise InvalidConfigError(
                f"The tokenizer in {folder} is remote code ({remote}); MoE Chat does not run a "
                "repository's code. Use a release of the model with a tokenizer.json."
            ) from err
        raise InvalidConfigError(f"The tokenizer in {folder} cannot be loaded: {err}") from err
