"""Decode-step attention on the CPU as two matrix products, each key head's query heads folded together.

Contract: `use_cpu_attention(hf_model)` switches a model that attends with transformers' `sdpa` to
`ATTENTION` (registered with transformers' attention and mask interfaces under that name), which
is `sdpa` itself except where `folded_attention` takes a step: a query of at most
`MAX_FOLDED_QUERIES` positions (a decode or verification step) on the CPU, with no position bias,
attention sinks or soft-capping, and a mask (if any) shared by the heads. There the query heads
of each key/value head become rows of one matrix (`[B, KV, G·Q, D]`, as transformers' `pack_gqa`
lays them out), so the scores and the output are two batched matmuls over the cache as it is,
with the numerics of transformers' eager attention (products in the model's dtype, the softmax
in float32).

Why: torch's CPU flash-attention kernel is built for long queries; for one query position over a
long cache it is several times slower than the folded products (in bfloat16 most of all), and at
the decode of every layer that is most of a long chat's step on the CPU.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTENTION = "moe_chat_cpu_sdpa"
MAX_FOLDED_QUERIES = 16  # a verification step of a long draft still counts as a decode step


def folded_attention(
    query: torch.Tensor,  # [B, H, Q, D]
    key: torch.Tensor,  # [B, KV, L, D]
    value: torch.Tensor,  # [B, KV, L, Dv]
    attention_mask: torch.Tensor | None,  # [B, 1, Q, L] boolean (True: attend) or additive floats
    scaling: float,
) -> torch.Tensor:
    """Softmax attention of every query head over its key/value head: `[B, H, Q, Dv]`."""
    batch, heads, queries, _ = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    packed = query.reshape(batch, kv_heads, group * queries, query.shape[-1])  # heads h = kv·G + g
    scores = torch.matmul(packed, key.transpose(-1, -2)) * scaling  # [B, KV, G·Q, L]
    if attention_mask is not None:
        scores = scores.view(batch, kv_heads, group, queries, length)
        mask = attention_mask[:, :, None]  # [B, 1, 1, Q, L]: the same for every head
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        scores = scores.view(batch, kv_heads, group * queries, length)
    weights = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)  # as transformers' eager path
    out = torch.matmul(weights, value)  # [B, KV, G·Q, Dv]
    return out.view(batch, heads, queries, value.shape[-1])


def cpu_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' `sdpa` attention, with decode steps on the CPU computed by `folded_attention`."""
    if not _folds(module, query, key, attention_mask, dropout, position_bias, kwargs):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout, scaling, is_causal, position_bias, **kwargs
        )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = folded_attention(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None  # [B, Q, H, Dv], as sdpa_attention_forward returns


def _folds(module, query, key, attention_mask, dropout, position_bias, kwargs) -> bool:
    queries = query.shape[2]
    return (
        query.device.type == "cpu"
        and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and queries <= MAX_FOLDED_QUERIES
        and (attention_mask is not None or queries == 1)  # no mask over several queries: causal
        and (attention_mask is None or (attention_mask.dim() == 4 and attention_mask.shape[1] == 1))
        and not (module.training and dropout > 0)
        and position_bias is None
        and kwargs.get("s_aux") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
        and query.shape[1] % key.shape[1] == 0
    )


AttentionInterface.register(ATTENTION, cpu_attention_forward)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_cpu_attention(hf_model: torch.nn.Module) -> bool:
    """Switch `hf_model` from `sdpa` to `ATTENTION`; False (left as it is) when it attends otherwise."""
    config = hf_model.config
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    hf_model.set_attn_implementation(ATTENTION)
    return config._attn_implementation == ATTENTION
