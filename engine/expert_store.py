"""Host-memory store of every routed expert, one contiguous buffer per (layer, expert).

An expert's fields (`gate_up_proj`, `down_proj`, biases …) are packed back to
back in one byte buffer described by an `ExpertLayout`, so moving an expert to
the device is exactly one copy. Each MoE layer's experts are one `[E, nbytes]`
uint8 tensor, pinned when the device is CUDA so copies run asynchronously at
full link speed.

Experts are read from the checkpoint one at a time straight into their row:
loading never holds a layer's experts twice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.checkpoint import Checkpoint
from engine.errors import CorruptCheckpointError, DeviceOutOfMemoryError, MissingTensorsError
from engine.models.base import DiskLayout

log = logging.getLogger(__name__)

ALIGN = 64  # bytes; keeps every field aligned for vectorised kernels and dtype views


@dataclass(frozen=True)
class ExpertField:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int  # bytes from the start of the expert's buffer

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class ExpertLayout:
    """Where each field of one expert lives inside its packed buffer."""

    fields: tuple[ExpertField, ...]
    nbytes: int

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> ExpertLayout:
        fields, offset = [], 0
        for name, shape in shapes.items():
            field = ExpertField(name, tuple(shape), dtype, offset)
            fields.append(field)
            offset += -(-field.nbytes // ALIGN) * ALIGN
        return cls(tuple(fields), offset)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed tensor views of one packed expert buffer (uint8, `nbytes` long)."""
        return {
            f.name: buffer[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in self.fields
        }


class ExpertStore:
    """Every routed expert of the model in host memory, packed."""

    def __init__(self, layout: ExpertLayout, layers: Mapping[int, torch.Tensor], num_experts: int):
        self.layout = layout
        self.num_experts = num_experts
        self._layers = dict(layers)  # layer index -> uint8 [E, nbytes]

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self._layers)

    def buffer(self, layer: int, expert: int) -> torch.Tensor:
        return self._layers[layer][expert]

    def views(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        return self.layout.views(self._layers[layer][expert])

    @property
    def total_experts(self) -> int:
        return len(self._layers) * self.num_experts

    @property
    def nbytes(self) -> int:
        return self.total_experts * self.layout.nbytes

    @property
    def pinned(self) -> bool:
        return all(buf.is_pinned() for buf in self._layers.values())


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


def build_store(
    checkpoint: Checkpoint,
    disk_layout: DiskLayout,
    moe_layers: Mapping[int, str],
    expected_shapes: Mapping[str, tuple[int, ...]],
    num_experts: int,
    dtype: torch.dtype,
    pin: bool,
    progress: Callable[[int, int], None] | None = None,
) -> ExpertStore:
    """Pack every expert of `moe_layers` (layer index → on-disk prefix) into host memory."""
    layout = ExpertLayout.from_shapes(expected_shapes, dtype)
    layers: dict[int, torch.Tensor] = {}
    total, done = len(moe_layers) * num_experts, 0
    for layer, prefix in sorted(moe_layers.items()):
        try:
            packed = torch.empty((num_experts, layout.nbytes), dtype=torch.uint8, pin_memory=pin)
        except RuntimeError as err:
            raise DeviceOutOfMemoryError(
                f"Cannot allocate {layout.nbytes * num_experts / 2**30:.1f} GiB of "
                f"{'pinned ' if pin else ''}host memory for layer {layer}'s experts ({err}). "
                "Close other programs or use a smaller model."
            ) from err
        for expert in range(num_experts):
            fields = read_expert(checkpoint, disk_layout, prefix, expert, dtype)
            views = layout.views(packed[expert])
            for name, tensor in fields.items():
                if tuple(tensor.shape) != views[name].shape:
                    raise CorruptCheckpointError(
                        f"Expert {expert} of {prefix.rstrip('.')} has {name} of shape {tuple(tensor.shape)}, "
                        f"but the config implies {tuple(views[name].shape)}. The config and weights disagree."
                    )
                views[name].copy_(tensor)
            done += 1
            if progress is not None:
                progress(done, total)
        layers[layer] = packed
    return ExpertStore(layout, layers, num_experts)
