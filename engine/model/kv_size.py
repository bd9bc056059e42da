"""How much a model's KV cache holds per token, from its config alone (no torch).

The catalog's fit estimate and the bench count it the same way: every attention layer keeps a key
and a value of `kv_heads × head_dim` per token, except that a sliding-window layer keeps at most
`window - 1` tokens (transformers' `DynamicCache(config=…)` drops the rest), and DeepSeek's MLA
layers keep their compressed latent (one head: `kv_lora_rank` wide keys, `qk_rope_head_dim` values).
An element is as wide as `--kv-dtype` stores it (`kv_element_bytes`): the compute dtype's width
unless another is chosen (an fp8 cache's per-head scales are a few bytes a layer, not counted).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class KvShape:
    layers: int
    kv_heads: int
    head_dim: int  # (key width + value width) / 2 where they differ (DeepSeek's MLA latent)
    sliding_layers: int = 0  # of `layers`, those that keep only the last `window` tokens
    window: int | None = None

    def __post_init__(self) -> None:
        numbers = (self.layers, self.kv_heads, self.head_dim)
        if not all(isinstance(n, int) and n > 0 for n in numbers):
            raise ValueError("layers, kv_heads and head_dim must be positive integers")
        if not 0 <= self.sliding_layers <= self.layers or (self.sliding_layers and not self.window):
            raise ValueError("sliding_layers must be at most layers, and come with their window")

    def nbytes(self, tokens: int, element_bytes: int = 2) -> int:
        """The cache after `tokens` tokens, keys and values of `element_bytes` each."""
        full = (self.layers - self.sliding_layers) * tokens
        sliding = self.sliding_layers * min(tokens, (self.window or 1) - 1)
        return 2 * self.kv_heads * self.head_dim * element_bytes * (full + sliding)

    @classmethod
    def from_config(cls, config: Mapping) -> KvShape:
        """From a transformers config.json (as a dict)."""
        heads = config["num_attention_heads"]
        if config.get("kv_lora_rank"):  # MLA: transformers keeps the latent and the rotary key part
            latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
            return cls(config["num_hidden_layers"], 1, latent // 2)
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        kinds = config.get("layer_types") or []
        sliding = sum(kind == "sliding_attention" for kind in kinds)
        window = config.get("sliding_window") if sliding else None
        kv_heads = config.get("num_key_value_heads") or heads
        return cls(config["num_hidden_layers"], kv_heads, head_dim, sliding, window)


KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
# an auto expert budget keeps device room for a KV cache this long (or the model's window, if shorter)
KV_RESERVE_TOKENS = 32768


def kv_element_bytes(kv_dtype: str, compute_bytes: int) -> int:
    """Bytes per stored key or value element: --kv-dtype's, or the compute dtype's for auto."""
    return compute_bytes if kv_dtype == "auto" else KV_ELEMENT_BYTES[kv_dtype]


def kv_reserve_bytes(config: Mapping, element_bytes: int, tokens: int = KV_RESERVE_TOKENS) -> int:
    """The KV cache of `tokens` tokens of context (the model's window when shorter); 0 for a
    config whose attention shape this cannot read (the auto budget's headroom then stands alone)."""
    try:
        shape = KvShape.from_config(config)
    except (KeyError, TypeError, ValueError):
        return 0
    window = config.get("max_position_embeddings") or tokens
    return shape.nbytes(min(tokens, window), element_bytes)
