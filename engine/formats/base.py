"""The protocol of a stored expert format: one object per format, as vLLM has one quantization method.

Contract: an `ExpertFormat` says whether a checkpoint holds its routed experts in this format
(`detect`), gives the checkpoint as the resident weights are read through it (`reader`: FP8 and
int4 weights read as floats, their scales hidden), says how it keeps the experts (`kept_as`), and
opens the checkpoint's experts against what the model expects of them (`open`, a `ModelExperts`)
as a `StoredExperts`: the layout of one expert of a layer (`layer_layout`, its fields each in a
`FieldFormat` that gives the weight: `engine.formats.fields`) and how one expert is written into
its row (`pack`). `kept_quantized` formats keep the checkpoint's own quantized bytes (asking for
another host precision is refused); the others hold floats the engine may quantize itself.
`repacks_for_cpu`: the format's blocks may be laid out for the CPU's kernels
(`engine.store.placement`), a choice made apart from the format.

`engine.formats.registry` lists the formats in the order the loader asks them;
`engine.store.build` is the one skeleton that packs any format's experts into a store.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from engine.formats.layout import ExpertLayout
from engine.model.adapters.base import Architecture, DiskLayout


@dataclass(frozen=True)
class ModelExperts:
    """What the model expects of its routed experts, read off transformers' experts modules."""

    arch: Architecture
    prefixes: dict[int, str]  # MoE layer -> its block's name in the checkpoint ("model.layers.3.mlp")
    shapes: dict[str, tuple[int, ...]]  # transformers' per-expert field shapes (`gate_up_proj` [2I, H] …)
    num_experts: int
    transposed: bool  # the family holds its weights `[in, out]` (gpt-oss)
    dtype: torch.dtype  # the compute dtype

    @classmethod
    def of(
        cls, arch: Architecture, blocks: Mapping[int, tuple[str, torch.nn.Module]], dtype: torch.dtype
    ) -> ModelExperts:
        """The experts of the MoE `blocks` (layer -> (name, block)), as the first block has them."""
        experts = next(iter(blocks.values()))[1].experts
        shapes = {name: tuple(param.shape[1:]) for name, param in experts.named_parameters(recurse=False)}
        prefixes = {layer: name for layer, (name, _) in sorted(blocks.items())}
        transposed = getattr(experts, "is_transposed", False)
        return cls(arch, prefixes, shapes, experts.num_experts, transposed, dtype)

    @property
    def layers(self) -> list[int]:
        return list(self.prefixes)


@runtime_checkable
class StoredExperts(Protocol):
    """One checkpoint's routed experts in one format, ready to be packed."""

    model: ModelExperts
    disk_layout: DiskLayout | None  # the safetensors tensors they come from (None: a GGUF file's)
    name: str  # how they lie on disk, as `ModelInfo.disk_layout` reports it

    def layer_layout(self, layer: int) -> ExpertLayout:
        """The fields of one expert of `layer`, the layer's tensors checked against the model."""
        ...

    def pack(self, layer: int, expert: int, views: Mapping[str, object]) -> None:
        """Write expert `expert` of `layer` into the views of its row (`layer_layout(layer).views`)."""
        ...


@runtime_checkable
class ExpertFormat(Protocol):
    """A format a checkpoint may hold its routed experts in."""

    name: str
    kept_quantized: bool
    repacks_for_cpu: bool

    def detect(self, hf_config, checkpoint) -> bool:
        """Whether `checkpoint` (as `open_checkpoint` gives it) holds its experts in this format; a
        format it names but cannot read is refused here, in one sentence."""
        ...

    def reader(self, hf_config, checkpoint):
        """`checkpoint` as the loader reads the resident weights through it."""
        ...

    def kept_as(self, checkpoint) -> tuple[str, str]:
        """The checkpoint's name as the user knows it, and how its experts are kept ("in FP8")."""
        ...

    def open(self, checkpoint, model: ModelExperts) -> StoredExperts:
        """The experts of `checkpoint` (its `reader`) as `model` expects them, checked."""
        ...
