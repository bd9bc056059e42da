"""Tiny checkpoints carrying multi-token-prediction weights under their published names.

`save_with_mtp(model_type, folder, perfect)` saves a tiny random model of `deepseek_v3` (MTP layer
`model.layers.{N}.` — enorm, hnorm, eh_proj, shared_head, embed_tokens and a decoder layer) or
`qwen3_5_moe` (a vision-language checkpoint with `mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`,
`mtp.layers.0.`), the MTP decoder layer a perturbed copy of the model's last full-attention MoE
layer as it lies on disk.

`perfect=True` makes a target whose next token depends on the current token only (every
attention/linear-attention output and every expert's down projection is zero, so the residual
stream is the token's embedding) and an MTP layer that computes exactly that map one token
further: `eh_proj = [I | 0]` keeps the embedding of token t+1, the block adds nothing, and its norm
is the target's final norm. Its drafts are then the target's own next tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from engine.tiny.models import TINY_ARCHITECTURES, save_tiny_model, tiny_config
from engine.tiny.registry import is_multimodal, shrunk_config

ZEROED = ("o_proj", "out_proj", "down_proj")  # what writes into the residual stream


def save_with_mtp(model_type: str, folder: Path, perfect: bool = False, seed: int = 0) -> Path:
    config = tiny_config(model_type) if model_type in TINY_ARCHITECTURES else shrunk_config(model_type)
    published = AutoModelForImageTextToText if is_multimodal(model_type) else AutoModelForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = published.from_config(config, dtype=torch.float32).eval()
        if perfect:
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if any(part in name for part in ZEROED):
                        param.zero_()
        folder = save_tiny_model(model, folder)
        _add_mtp(folder, model, perfect)
    return folder


def _add_mtp(folder: Path, model, perfect: bool) -> None:
    text = model.config.get_text_config()
    hidden = text.hidden_size
    decoder = model.get_decoder()
    tensors = load_file(folder / "model.safetensors")
    language = (
        "model.language_model." if any(k.startswith("model.language_model.") for k in tensors) else "model."
    )
    source = max(
        i
        for i, t in enumerate(getattr(text, "layer_types", None) or ["full_attention"] * 99)
        if i < text.num_hidden_layers and t in ("full_attention", "indexed_attention")
    )
    unit = type(decoder.norm)(hidden).weight.detach()  # a norm weight that scales by one (1 or 0)
    noise = torch.Generator().manual_seed(11)

    def near(value: torch.Tensor) -> torch.Tensor:
        return value.clone() if perfect else value + 0.05 * torch.randn(value.shape, generator=noise)

    eh_proj = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    if not perfect:
        eh_proj = torch.randn(hidden, 2 * hidden, generator=noise) / (2 * hidden) ** 0.5
    final_norm = tensors[f"{language}norm.weight"]
    if text.model_type.startswith("qwen3"):
        prefix, config_key = "mtp.layers.0.", "mtp_num_hidden_layers"
        parts = {
            "mtp.fc": eh_proj,
            "mtp.pre_fc_norm_embedding": near(unit),
            "mtp.pre_fc_norm_hidden": near(unit),
        }
        parts["mtp.norm"] = near(final_norm)
    else:
        prefix, config_key = f"model.layers.{text.num_hidden_layers}.", "num_nextn_predict_layers"
        parts = {prefix + "eh_proj": eh_proj, prefix + "enorm": near(unit), prefix + "hnorm": near(unit)}
        parts[prefix + "shared_head.norm"] = near(final_norm)
        parts[prefix + "shared_head.head"] = tensors["lm_head.weight"].clone()
        parts[prefix + "embed_tokens"] = tensors[f"{language}embed_tokens.weight"].clone()
    layer = f"{language}layers.{source}."
    tensors.update(
        {prefix + k.removeprefix(layer): near(v) for k, v in tensors.items() if k.startswith(layer)}
    )
    tensors.update({f"{name}.weight": value.contiguous() for name, value in parts.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors", {"format": "pt"})
    raw = json.loads((folder / "config.json").read_text())
    (raw.get("text_config") or raw)[config_key] = 1
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
