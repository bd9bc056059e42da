"""Float experts as a safetensors checkpoint holds them, kept as they are or quantized by the engine.

Contract: `NATIVE` is the format of a checkpoint no other format claims (`engine.formats.registry`
asks it last): every expert read in the model's own layout (`read_expert`: a row of transformers'
fused tensors, or its per-expert matrices stacked) and copied into plain fields.
`IntQuantFormat(spec)` is the engine's own group-wise int8/int4 (`engine.formats.int_quant`): the
same experts, each weight matrix quantized as it is read. No checkpoint is detected as it: the
loader chooses it (`--expert-dtype`, or host memory too small for the floats).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.errors import CorruptCheckpointError, MissingTensorsError
from engine.formats.base import ModelExperts
from engine.formats.int_quant import QuantSpec, quantize_into
from engine.formats.layout import ExpertLayout
from engine.model.adapters.base import DiskLayout
from engine.model.checkpoint import Checkpoint


def find_layout(checkpoint: Checkpoint, layouts: tuple[DiskLayout, ...], layer_prefix: str) -> DiskLayout:
    """The on-disk layout this checkpoint uses, judged from its first MoE layer."""
    for layout in layouts:
        names = [n for group in layout.names(layer_prefix, 0).values() for n in group]
        if all(n in checkpoint for n in names):
            return layout
    expected = "; ".join(
        ", ".join(n for group in layout.names(layer_prefix, 0).values() for n in group) for layout in layouts
    )
    raise MissingTensorsError(
        f"No routed-expert tensors for {layer_prefix.rstrip('.')} in {checkpoint.folder}. "
        f"Expected one of: {expected}. The checkpoint is incomplete or not in a supported layout."
    )


def read_expert(
    checkpoint: Checkpoint, layout: DiskLayout, layer_prefix: str, expert: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """One expert's fields in the model's own layout (a row of transformers' fused tensors)."""
    fields = {}
    for field_name, names in layout.names(layer_prefix, expert).items():
        if layout.per_expert:
            parts = [checkpoint.read(name, dtype) for name in names]
        else:
            parts = [checkpoint.read_index(name, expert, dtype) for name in names]
        fields[field_name] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
    return fields


def pack_expert(
    fields: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor], quant: QuantSpec | None
) -> None:
    """Write one expert's fields into its packed views: copied, or quantized where the layout says."""
    for name, tensor in fields.items():
        if name in views:
            views[name].copy_(tensor)
        else:
            quantize_into(tensor, views, name, quant)


class NativeExperts:
    """A float checkpoint's experts, each read in the model's layout, checked and packed (quantized
    with `quant`)."""

    def __init__(self, checkpoint: Checkpoint, model: ModelExperts, quant: QuantSpec | None):
        self.checkpoint, self.model, self.quant = checkpoint, model, quant
        first = next(iter(model.prefixes.values()))
        self.disk_layout = find_layout(checkpoint, model.arch.layouts, first + ".")
        self.name = self.disk_layout.name
        native = ExpertLayout.from_shapes(model.shapes, model.dtype)
        self._layout = native.quantized(quant) if quant is not None else native

    def layer_layout(self, layer: int) -> ExpertLayout:
        return self._layout

    def pack(self, layer: int, expert: int, views) -> None:
        prefix, shapes = self.model.prefixes[layer], self.model.shapes
        fields = read_expert(self.checkpoint, self.disk_layout, prefix + ".", expert, self.model.dtype)
        for name, tensor in fields.items():
            if tuple(tensor.shape) != shapes[name]:
                raise CorruptCheckpointError(
                    f"Expert {expert} of {prefix} has {name} of shape {tuple(tensor.shape)}, "
                    f"but the config implies {shapes[name]}. The config and weights disagree."
                )
        pack_expert(fields, views, self.quant)


class NativeFormat:
    """Experts as floats, as the checkpoint stores them."""

    name, kept_quantized, repacks_for_cpu = "native", False, False

    def detect(self, hf_config, checkpoint) -> bool:
        return isinstance(checkpoint, Checkpoint)

    def reader(self, hf_config, checkpoint):
        return checkpoint

    def kept_as(self, checkpoint) -> tuple[str, str]:
        return checkpoint.folder.name, "as floats"

    def open(self, checkpoint: Checkpoint, model: ModelExperts) -> NativeExperts:
        return NativeExperts(checkpoint, model, None)


@dataclass(frozen=True)
class IntQuantFormat(NativeFormat):
    """A float checkpoint's experts quantized by the engine as they are read (`spec`)."""

    spec: QuantSpec

    @property
    def name(self) -> str:
        return self.spec.name

    def detect(self, hf_config, checkpoint) -> bool:
        return False  # the engine's own: chosen by the loader, never found in a checkpoint

    def kept_as(self, checkpoint) -> tuple[str, str]:
        return checkpoint.folder.name, f"as {self.spec.name}"

    def open(self, checkpoint: Checkpoint, model: ModelExperts) -> NativeExperts:
        return NativeExperts(checkpoint, model, self.spec)


NATIVE = NativeFormat()
