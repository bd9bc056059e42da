"""A checkpoint's own multi-token-prediction (MTP) layer, read as a small resident module.

Contract: `find_mtp(hf_config, names)` says whether and where a checkpoint keeps MTP weights, in
either of the two published formats, and `build_mtp_head` makes the empty `MtpHead` they fill
(engine.speculative.mtp reads them, experts included, and drafts with it):

- nextn (DeepSeek-V3, GLM-4.5/4.6): `num_nextn_predict_layers` layers stored after the decoder as
  `model.layers.{num_hidden_layers + k}.` — `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`
  (`shared_head.head` and `embed_tokens` are copies of the model's own, which are used instead),
  and a whole decoder layer with its MoE under the same prefix;
- mtp (Qwen3-Next, Qwen3.5/3.6-MoE): `mtp_num_hidden_layers` layers as `mtp.fc` (the `eh_proj`),
  `mtp.pre_fc_norm_embedding` / `mtp.pre_fc_norm_hidden` (`enorm` / `hnorm`), `mtp.norm` and
  `mtp.layers.{k}.` (a full-attention decoder layer with its MoE); lm_head and embedding shared.

One MTP step (vLLM's deepseek_mtp / qwen3_next_mtp): the target's last hidden state `h_t` (after
its final norm) and the embedding of token t+1 give
`x = eh_proj([enorm(embed(t+1)); hnorm(h_t)])`, `y = layer(x)` and `logits = lm_head(norm(y))`,
the next-token-after-t+1 distribution. Drafting further feeds the step's own hidden state back in
as `h`: the un-normed `y` in the nextn format (its norm is the head's), the normed one in Qwen's.
Only the first MTP layer drafts (every published checkpoint has one); later ones are not read.

The decoder layer is transformers' own class of the model, built from the model's text config cut
to one full-attention MoE layer (as transformers' `get_mtp_config` does), so attention, RoPE and the
router are the family's. Its routed experts stay resident in transformers' experts module: one
layer's worth (≈1.5 GB for Qwen3.6-35B-A3B in bf16), read through the family's expert disk layouts,
so a draft step never copies an expert over the link that verification's prefetches use.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import DynamicCache
from transformers.masking_utils import create_causal_mask

from engine.errors import InvalidRequestError, UnsupportedArchitectureError
from engine.model.adapters.generic import is_routed_experts
from engine.model.hf_calls import decoder_of, with_cache

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MtpFormat:
    """Where one checkpoint keeps its first MTP layer."""

    name: str  # "nextn" | "mtp"
    layers: int  # MTP layers the checkpoint has (only the first drafts)
    layer_prefix: str  # the decoder layer's weights: "model.layers.61." or "mtp.layers.0."
    parts: dict[str, str]  # MtpHead part -> its on-disk name (".weight" added)
    chain_normed: bool  # a chained step is fed the normed hidden state (Qwen) or the raw one (nextn)


def find_mtp(hf_config, names: Iterable[str]) -> MtpFormat | None:
    """The MTP layer the checkpoint holds (the config counts it and its weights are there), or None."""
    text = hf_config.get_text_config()
    names = set(names)
    nextn = getattr(text, "num_nextn_predict_layers", 0) or 0
    if nextn > 0:
        suffix = f"layers.{text.num_hidden_layers}.eh_proj.weight"
        found = sorted(n for n in names if n == suffix or n.endswith("." + suffix))
        if found:
            prefix = found[0].removesuffix("eh_proj.weight")
            parts = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"}
            return MtpFormat("nextn", nextn, prefix, {k: prefix + v for k, v in parts.items()}, False)
    qwen = getattr(text, "mtp_num_hidden_layers", 0) or 0
    if qwen > 0 and "mtp.fc.weight" in names:
        parts = {
            "enorm": "mtp.pre_fc_norm_embedding",
            "hnorm": "mtp.pre_fc_norm_hidden",
            "eh_proj": "mtp.fc",
            "norm": "mtp.norm",
        }
        return MtpFormat("mtp", qwen, "mtp.layers.0.", parts, True)
    return None


def mtp_layer_config(text_config):
    """The model's text config cut to one global-attention MoE decoder layer (index 0): full
    attention, or the family's own kind of it (DeepSeek-V3.2's and GLM-5's `indexed_attention`)."""
    config = copy.deepcopy(text_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [_global_attention(config.layer_types)]
    if getattr(config, "mlp_layer_types", None) is not None:
        config.mlp_layer_types = ["sparse"]
    for dense_first in ("first_k_dense_replace", "first_dense_layers"):
        if hasattr(config, dense_first):
            setattr(config, dense_first, 0)
    if hasattr(config, "mlp_only_layers"):
        config.mlp_only_layers = []
    return config


def _global_attention(layer_types: list[str]) -> str:
    """The model's last layer type that attends to the whole context ("full_attention" if none)."""
    local = ("linear", "sliding", "chunked", "mamba", "conv")
    return next((t for t in reversed(layer_types) if not any(k in t for k in local)), "full_attention")


class MtpHead(nn.Module):
    """One MTP step over `T` positions: `(embeds [T, H], hidden [T, H]) -> (chained [T, H], normed [T, H])`.

    `get_decoder().layers` is its one decoder layer, so SP-MoE's draft-model hooks can route its
    residual stream through the target's routers as they do a draft model's."""

    def __init__(self, config, layer: nn.Module, norm_cls: type[nn.Module], chain_normed: bool):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.config = config
        self.chain_normed = chain_normed
        self.enorm = norm_cls(hidden, eps=eps)
        self.hnorm = norm_cls(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([layer])
        self.norm = norm_cls(hidden, eps=eps)
        self.kept = None  # the latest reply's MTP cache (engine.speculative.mtp.KeptMtpCache)

    def get_decoder(self) -> MtpHead:
        return self

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.config)

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cache: DynamicCache, rotary: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start = cache.get_seq_length()
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))[None]  # [1, T, H]
        # positions count from the MTP cache's first entry: RoPE is relative, so an offset shared by
        # every entry changes nothing
        positions = torch.arange(start, start + x.shape[1], device=x.device)[None]  # [1, T]
        # always a mask (DeepSeek-V3.2's indexer reads it, as its model's forward always makes one)
        mask = create_causal_mask(self.config, x, None, cache, positions, allow_is_causal_skip=False)
        layer = self.layers[0]
        y = layer(
            x,
            position_embeddings=rotary(x, positions),
            attention_mask=mask,
            position_ids=positions,
            **with_cache(layer, cache, use_cache=True),
        )
        y = (y[0] if isinstance(y, tuple) else y)[0]  # [T, H]
        normed = self.norm(y)
        return (normed if self.chain_normed else y), normed


def build_mtp_head(hf_model: nn.Module, mtp: MtpFormat, dtype: torch.dtype) -> MtpHead:
    """The head's modules on the meta device, shaped by the target model's own classes."""
    layers = decoder_of(hf_model).layers
    moe_layer = next((layer for layer in layers if _has_routed_experts(layer)), layers[-1])
    config = mtp_layer_config(hf_model.config)
    with torch.device("meta"):
        layer = type(moe_layer)(config, 0)
        head = MtpHead(config, layer, type(moe_layer.input_layernorm), mtp.chain_normed).to(dtype)
    if not _has_routed_experts(layer):
        raise UnsupportedArchitectureError(
            f"{hf_model.config.model_type}'s decoder layer built for the MTP layer has no routed experts; "
            "its MTP layer cannot be read yet. Use another --spec."
        )
    return head


def _has_routed_experts(layer: nn.Module) -> bool:
    return any(is_routed_experts(module) for module in layer.modules())


def require_mtp(hf_config, names: Iterable[str], where: str) -> MtpFormat:
    """The checkpoint's MTP layer, or the error `--spec mtp` gives for a checkpoint without one."""
    mtp = find_mtp(hf_config, names)
    if mtp is None:
        raise InvalidRequestError(
            f"--spec mtp drafts with the checkpoint's multi-token-prediction layer, and {where} has none "
            f"({hf_config.get_text_config().model_type}: no num_nextn_predict_layers / mtp_num_hidden_layers "
            "layer weights). Use --spec self or draft."
        )
    return mtp
