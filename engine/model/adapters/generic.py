"""The one architecture adapter: a family's MoE structure read from transformers' own modules.

transformers 5 routes the experts of its MoE families through one interface
(`transformers.integrations.moe.use_experts_implementation`): the experts module holds fused
`[E, …]` parameters (`gate_up_proj` or `up_proj`, `down_proj`, maybe `*_bias`), says
`has_gate`, `has_bias`, `is_transposed` and provides the activation (`_apply_gate`, `act_fn`,
clamped or interleaved as the family has it), and is called `experts(hidden, top_k_index,
top_k_weights)`. `bind` finds, in a model built on the meta device:

- the routed-experts modules: a decoder layer's own `experts` or one in a child block
  (`mlp`, `block_sparse_moe`, `feed_forward`, `mixer` …); shared experts are the block's other
  children and stay resident;
- the router: the block's child named `gate` or `router`;
- the disk layouts: the fused in-memory names, and the per-expert names transformers'
  conversion mapping merges into them (`experts.*.w1.weight` + `w3` → `gate_up_proj`), each also
  under the names its renamings undo (Mixtral's `block_sparse_moe`, Granite's `input_linear`).

What truly differs per family is in `overrides.OVERRIDES`, each entry with the test needing it;
a block off the interface (Llama 4's) is rewritten onto it first (`rewrites`).
"""

from __future__ import annotations

import dataclasses
import re

from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming

from engine.errors import UnsupportedArchitectureError
from engine.model.adapters.base import EXPERT, Architecture, DiskLayout
from engine.model.adapters.rewrites import rewrite_moe_blocks
from engine.model.hf_calls import decoder_of

ROUTER_NAMES = ("gate", "router")
# How configs name the number of experts each token is routed to (Gemma 4: top_k_experts).
TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k_experts", "moe_k", "num_selected_experts")
_PLAIN = re.compile(r"^[\w.]+$")  # a renaming pattern that is a plain name, not a regex


def is_routed_experts(module: nn.Module) -> bool:
    """Whether `module` is a transformers experts module on the experts interface."""
    return hasattr(module, "has_gate") and hasattr(module, "down_proj") and hasattr(module, "num_experts")


def experts_per_token(config) -> int:
    """The routed experts per token (top-k) the language model's `config` declares."""
    for key in TOP_K_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    raise UnsupportedArchitectureError(
        f"{config.model_type}'s config names no experts-per-token count (one of {', '.join(TOP_K_KEYS)})."
    )


def _moe_attr(layer: nn.Module) -> str | None:
    """The attribute of a decoder layer holding the routed experts' block ("" for the layer itself)."""
    if is_routed_experts(getattr(layer, "experts", None) or nn.Module()):
        return ""
    for name, child in layer.named_children():
        if is_routed_experts(getattr(child, "experts", None) or nn.Module()):
            return name
    return None


def _router_attr(block: nn.Module) -> str:
    for name in ROUTER_NAMES:
        if isinstance(getattr(block, name, None), nn.Module):
            return name
    raise UnsupportedArchitectureError(f"{type(block).__name__} has routed experts but no gate or router.")


def _unescaped(pattern: str) -> str | None:
    plain = pattern.replace("\\.", ".")
    return plain if _PLAIN.match(plain) else None


def _renamings(hf_model: nn.Module) -> list[tuple[str, str]]:
    """(in-memory, on-disk) name fragments of the model's plain renamings."""
    pairs = []
    for transform in get_model_conversion_mapping(hf_model):
        if not isinstance(transform, WeightRenaming):
            continue
        for source in transform.source_patterns:
            for target in transform.target_patterns:
                plain_source, plain_target = _unescaped(source), _unescaped(target)
                if plain_source and plain_target:
                    pairs.append((plain_target, plain_source))
    return pairs


def _per_expert_sources(hf_model: nn.Module, experts_path: str, fields: list[str]) -> dict | None:
    """Each fused field's per-expert on-disk names, from the converters that merge them; None when
    some field has no such converter (the family is stored fused only)."""
    sources = {}
    for transform in get_model_conversion_mapping(hf_model):
        if not isinstance(transform, WeightConverter):
            continue
        for target in transform.target_patterns:
            suffix = target.lstrip(".")
            for field in fields:
                name = f"{experts_path}.{field}"
                if name.endswith(suffix) and all("*" in s for s in transform.source_patterns):
                    base = name[: -len(suffix)]
                    sources[field] = tuple(
                        base + s.lstrip(".").replace("*", EXPERT) for s in transform.source_patterns
                    )
    return sources if set(sources) == set(fields) else None


def _published(name: str, renamings: list[tuple[str, str]]) -> str:
    for memory, disk in renamings:
        if memory in "." + name:
            return ("." + name).replace(memory, disk, 1).lstrip(".")
    return name


def _renamed(sources: dict, renamings: list[tuple[str, str]]) -> list[dict]:
    """`sources` under the names the renamings undo (in-memory → on-disk), if that changes any."""
    renamed = {field: tuple(_published(n, renamings) for n in names) for field, names in sources.items()}
    return [renamed] if renamed != sources else []


def disk_layouts(hf_model: nn.Module, experts_path: str, experts: nn.Module) -> tuple[DiskLayout, ...]:
    """Every on-disk layout of one layer's experts, relative to the decoder layer: per-expert
    before fused, names as published (renamings undone) before the in-memory ones."""
    fields = [name for name, _ in experts.named_parameters(recurse=False)]
    fused = {field: (f"{experts_path}.{field}",) for field in fields}
    renamings = _renamings(hf_model)
    layouts = []
    per_expert = _per_expert_sources(hf_model, experts_path, fields)
    if per_expert is not None:
        for sources in (*_renamed(per_expert, renamings), per_expert):
            prefix = next(iter(sources.values()))[0].split(f".{EXPERT}.")[0]
            layouts.append(DiskLayout(name=f"per-expert {prefix}", sources=sources))
    for sources in (*_renamed(fused, renamings), fused):
        prefix = next(iter(sources.values()))[0].rsplit(".", 1)[0]
        layouts.append(DiskLayout(name=f"fused {prefix}", sources=sources))
    return tuple(layouts)


def bind(arch: Architecture, hf_model: nn.Module) -> Architecture:
    """`arch` completed from `hf_model` (built on the meta device): where its MoE blocks and
    routers are and how its experts are laid out on disk. Overrides already in `arch` win.
    A MoE block off the experts interface is first rewritten onto it (engine.model.adapters.rewrites)."""
    rewrite_moe_blocks(hf_model)
    for layer in decoder_of(hf_model).layers:
        moe_attr = _moe_attr(layer)
        if moe_attr is None:
            continue
        block = getattr(layer, moe_attr) if moe_attr else layer
        experts_path = f"{moe_attr}.experts" if moe_attr else "experts"
        layouts = disk_layouts(hf_model, experts_path, block.experts)
        extra = tuple(layout for layout in arch.layouts if layout not in layouts)
        return dataclasses.replace(
            arch,
            moe_attr=moe_attr,
            router_attr=arch.router_attr or _router_attr(block),
            layouts=layouts + extra,
        )
    raise UnsupportedArchitectureError(
        f"{arch.model_type} has no layers with routed experts on transformers' experts interface."
    )
