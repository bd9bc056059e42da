"""What the engine knows about a model family: where its routed experts are and how they lie on disk.

transformers 5 gives every MoE family the same shape: a decoder layer holds a MoE block (`mlp`,
`block_sparse_moe`, `mixer` … or the layer itself) whose router (`gate` or `router`) returns
`(router_logits, top_k_weights, top_k_index)` and whose `experts` module is called as
`experts(hidden, top_k_index, top_k_weights)`. Attention, norms, RoPE, the KV cache (or recurrent
state), routers, shared experts and dense layers are transformers' own modules and stay resident;
the engine replaces only `experts`. An `Architecture` says where that block is, which router it
has, and how the routed experts are named on disk, in each layout checkpoints use:

- per expert: `<layer>.mlp.experts.<e>.gate_proj.weight` (Mixtral:
  `block_sparse_moe.experts.<e>.w1.weight`), one tensor per expert and matrix;
- fused: `<layer>.mlp.experts.gate_up_proj` `[E, 2I, H]`, one tensor per layer.

Field names are those of transformers' fused experts module (`gate_up_proj`, `down_proj`,
`*_bias`); one expert's field is that tensor's row `[e]`. `engine.model.adapters.generic.bind`
fills the block, router and layouts in from the model itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

EXPERT = "{e}"  # placeholder for the expert index in per-expert names


@dataclass(frozen=True)
class DiskLayout:
    """How one expert's fields are found on disk, relative to the decoder layer's prefix.

    `sources[field]` lists on-disk names concatenated along dim 0 to make the field
    (gate and up make `gate_up_proj`). Names containing `{e}` are per-expert tensors;
    the others are fused `[E, …]` tensors from which row e is read.
    """

    name: str
    sources: dict[str, tuple[str, ...]]

    @property
    def per_expert(self) -> bool:
        return any(EXPERT in name for names in self.sources.values() for name in names)

    def names(self, layer_prefix: str, expert: int) -> dict[str, tuple[str, ...]]:
        return {
            field_name: tuple(layer_prefix + name.replace(EXPERT, str(expert)) for name in names)
            for field_name, names in self.sources.items()
        }


def per_expert_layout(experts: str, gate: str, up: str, down: str, suffix: str = ".weight") -> DiskLayout:
    """Separate gate/up/down matrices per expert (Qwen, OLMoE, DeepSeek, Mixtral's w1/w3/w2)."""
    base = f"{experts}.{EXPERT}."
    return DiskLayout(
        name=f"per-expert {experts}",
        sources={
            "gate_up_proj": (base + gate + suffix, base + up + suffix),
            "down_proj": (base + down + suffix,),
        },
    )


def fused_layout(experts: str, *, gate_up: str = "gate_up_proj", down: str = "down_proj", bias: bool = False):
    """One stacked tensor per layer and matrix, as transformers 5 holds them in memory."""
    sources = {"gate_up_proj": (f"{experts}.{gate_up}",), "down_proj": (f"{experts}.{down}",)}
    if bias:
        sources["gate_up_proj_bias"] = (f"{experts}.{gate_up}_bias",)
        sources["down_proj_bias"] = (f"{experts}.{down}_bias",)
    return DiskLayout(name=f"fused {experts}", sources=sources)


@dataclass(frozen=True)
class Architecture:
    """One Hugging Face `model_type` the engine can offload.

    Built from the model type alone (`engine.model.adapters.get_architecture`), it holds what the
    family's override entry says; `generic.bind` completes it from the model built on the meta
    device (`moe_attr`, `router_attr`, `layouts`)."""

    model_type: str
    router_rule: str = "the family's transformers router"  # human-readable, for logs and `--help`
    layouts: tuple[DiskLayout, ...] = ()  # an override's extra layouts; `bind` adds the derived ones
    moe_attr: str | None = None  # attribute of the decoder layer holding the MoE block ("": the layer)
    router_attr: str = ""  # attribute of the MoE block holding the router ("": found by `bind`)
    notes: str = ""
    # config keys whose presence means weights we cannot compute with yet (MXFP4 experts in fused
    # `_blocks`/`_scales` tensors, as gpt-oss ships them, load: engine.formats.mxfp4_experts; FP8
    # checkpoints with per-expert matrices too: engine.formats.fp8_experts, and GPTQ/AWQ int4 ones:
    # engine.formats.int4_experts)
    unsupported_quantization: tuple[str, ...] = field(default=("bitsandbytes",))
