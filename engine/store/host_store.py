"""Host-memory store of every routed expert, one contiguous buffer per (layer, expert).

An expert's fields (`gate_up_proj`, `down_proj`, biases …) are packed back to
back in one byte buffer described by an `ExpertLayout`, so moving an expert to
the device is exactly one copy. Each MoE layer's experts are one `[E, nbytes]`
uint8 tensor, pinned when the device is CUDA so copies run asynchronously at
full link speed.

Experts are read from the checkpoint one at a time straight into their row:
loading never holds a layer's experts twice. With a `QuantSpec`, each expert's
weight matrices are quantized as they are read (`engine.formats.int_quant`): the layout then
has mixed-dtype fields (codes, scales, offsets) and `layout.quant` says so.
`quantize_store` makes such a copy of a loaded store, and `ExpertStore.to` puts a
store on the device (SubSpec's resident low-bit substitutes). A checkpoint's own quantized
experts keep their format: ggml blocks (`from_ggml`) and FP8 values with their block scales
(`from_fp8`, `engine.formats.fp8`), GPTQ/AWQ int4 words with their zeros and scales (`from_int4`,
`engine.formats.int4`), which `views` hands out as `GgmlWeight`, `Fp8Weight` and `Int4Weight`.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine import huge_pages
from engine.errors import CorruptCheckpointError, DeviceOutOfMemoryError, MissingTensorsError
from engine.formats.fp8 import FP8_DTYPE, Fp8Weight, scale_shape
from engine.formats.gguf_blocks import linear as ggml_linear
from engine.formats.gguf_repack import GGML_PACKINGS, repacked_linear
from engine.formats.int4 import Int4Weight, packed_shapes
from engine.formats.int_quant import QuantSpec, is_weight, quantize_into, quantized_fields
from engine.ggml import kernels as ggml_kernels
from engine.model.adapters.base import DiskLayout
from engine.model.checkpoint import Checkpoint

log = logging.getLogger(__name__)

ALIGN = 64  # bytes; keeps every field aligned for vectorised kernels and dtype views


@dataclass(frozen=True)
class ExpertField:
    name: str
    shape: tuple[int, ...]  # of the stored array (a ggml field: rows × bytes per row)
    dtype: torch.dtype
    offset: int  # bytes from the start of the expert's buffer
    ggml_type: int | None = None  # a GGUF file's quantized blocks, as the file has them
    weight_shape: tuple[int, ...] | None = None  # a ggml field's weight: (out, in), rows of blocks
    block: tuple[int, int] | None = None  # an FP8 field's scale block (its scales: `<name>.scale_inv`)
    int4: str | None = None  # an int4 field's format (its qweight; `<name>.qzeros`, `.scales`, `.g_idx`)
    packing: str | None = None  # a ggml field repacked for the CPU (`engine.formats.gguf_repack`)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class GgmlWeight(NamedTuple):
    """The view of a ggml field: its blocks, their type, and the `(out, in)` weight they hold."""

    data: torch.Tensor  # uint8 [out, bytes per row]
    ggml_type: int
    shape: tuple[int, int]
    packing: str | None = None  # repacked at load for the CPU (`engine.formats.gguf_repack`)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: how `engine.formats.int_quant.linear` computes this format."""
        if self.packing in GGML_PACKINGS:  # interleaved rows too: ggml knows them by their memory
            return ggml_kernels.linear(x, self.data, self.ggml_type, *self.shape)
        if self.packing is not None:
            return repacked_linear(self.packing, x, self.data, *self.shape)
        return ggml_linear(x, self.data, self.ggml_type, *self.shape)


@dataclass(frozen=True)
class ExpertLayout:
    """Where each field of one expert lives inside its packed buffer."""

    fields: tuple[ExpertField, ...]
    nbytes: int
    quant: QuantSpec | None = None  # None: every field as the checkpoint has it

    @classmethod
    def from_fields(
        cls, fields: Iterable[tuple[str, tuple[int, ...], torch.dtype]], quant: QuantSpec | None = None
    ) -> ExpertLayout:
        """Fields `(name, shape, dtype)` back to back, each starting on an `ALIGN`-byte boundary."""
        return cls._placed(
            [ExpertField(name, tuple(shape), dtype, 0) for name, shape, dtype in fields], quant
        )

    @classmethod
    def from_ggml(cls, fields: Iterable[tuple[str, tuple[int, int], int, int, str | None]]) -> ExpertLayout:
        """Fields `(name, (out, in), ggml_type, bytes per row, packing)` of a GGUF file, kept in its
        blocks (packing None) or repacked for the CPU (`engine.formats.gguf_repack`)."""
        return cls._placed(
            [
                ExpertField(name, (out, row_bytes), torch.uint8, 0, ggml_type, (out, columns), packing=pack)
                for name, (out, columns), ggml_type, row_bytes, pack in fields
            ]
        )

    @classmethod
    def from_fp8(cls, fields: Iterable[tuple[str, tuple[int, int], tuple[int, int]]]) -> ExpertLayout:
        """Fields `(name, (out, in), (b_out, b_in))` kept in FP8: e4m3 values, then float32 scales."""
        placed = []
        for name, (out, columns), block in fields:
            placed.append(ExpertField(name, (out, columns), FP8_DTYPE, 0, block=tuple(block)))
            scales = scale_shape((out, columns), block)
            placed.append(ExpertField(f"{name}.scale_inv", scales, torch.float32, 0))
        return cls._placed(placed)

    @classmethod
    def from_int4(cls, fields: Iterable[tuple[str, tuple[int, int], str, int, int]]) -> ExpertLayout:
        """Fields `(name, (out, in), format, groups, g_idx rows)` of a GPTQ/AWQ checkpoint, kept in
        its int32 words: qweight, qzeros, fp16 scales and, for act-order, one g_idx row per matrix."""
        placed = []
        for name, (out, columns), fmt, groups, g_idx_rows in fields:
            shapes = packed_shapes(fmt, (out, columns), groups)
            placed.append(
                ExpertField(name, shapes["qweight"], torch.int32, 0, weight_shape=(out, columns), int4=fmt)
            )
            placed.append(ExpertField(f"{name}.qzeros", shapes["qzeros"], torch.int32, 0))
            placed.append(ExpertField(f"{name}.scales", shapes["scales"], torch.float16, 0))
            if g_idx_rows:
                placed.append(ExpertField(f"{name}.g_idx", (g_idx_rows, columns), torch.int32, 0))
        return cls._placed(placed)

    @classmethod
    def _placed(cls, fields: list[ExpertField], quant: QuantSpec | None = None) -> ExpertLayout:
        placed, offset = [], 0
        for field in fields:
            placed.append(dataclasses.replace(field, offset=offset))
            offset += -(-field.nbytes // ALIGN) * ALIGN
        return cls(tuple(placed), offset, quant)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> ExpertLayout:
        return cls.from_fields((name, shape, dtype) for name, shape in shapes.items())

    def quantized(self, spec: QuantSpec) -> ExpertLayout:
        """This native layout with every weight matrix replaced by its quantized fields."""
        if self.quant is not None:
            raise ValueError(f"The layout is already quantized ({self.quant.name}).")
        if any(f.block is not None or f.int4 is not None for f in self.fields):
            raise ValueError("The layout holds FP8 or int4 experts: they are quantized already.")
        fields = []
        for f in self.fields:
            if is_weight(f.shape):
                fields += quantized_fields(f.name, f.shape, spec, f.dtype)
            else:
                fields.append((f.name, f.shape, f.dtype))
        return ExpertLayout.from_fields(fields, spec)

    def views(self, buffer: torch.Tensor) -> dict[str, torch.Tensor | GgmlWeight | Fp8Weight | Int4Weight]:
        """Typed tensor views of one packed expert buffer (uint8, at least `nbytes` long).

        An FP8 field is one `Fp8Weight` of its values and its `.scale_inv` field; an int4 field one
        `Int4Weight` of its qweight and its `.qzeros`, `.scales` (and `.g_idx`) fields."""
        views = {}
        for f in self.fields:
            view = buffer[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape)
            if f.ggml_type is not None:
                view = GgmlWeight(view, f.ggml_type, f.weight_shape, f.packing)
            views[f.name] = view
        for f in self.fields:
            if f.block is not None:
                views[f.name] = Fp8Weight(views[f.name], views.pop(f"{f.name}.scale_inv"), f.block)
            elif f.int4 is not None:
                qzeros, scales = views.pop(f"{f.name}.qzeros"), views.pop(f"{f.name}.scales")
                g_idx = views.pop(f"{f.name}.g_idx", None)
                views[f.name] = Int4Weight(views[f.name], qzeros, scales, g_idx, f.int4, f.weight_shape)
        return views


class ExpertStore:
    """Every routed expert of the model, packed: in host memory, or on a device after `to`.

    Usually every layer has the same layout. A GGUF file may quantize layers differently
    (Q4_K_M gives some layers' down projections more bits): then each layer has its own
    (`layer_layouts`), and `layout` is the widest, whose size a device slot has."""

    def __init__(
        self,
        layout: ExpertLayout,
        layers: Mapping[int, torch.Tensor],
        num_experts: int,
        layer_layouts: Mapping[int, ExpertLayout] | None = None,
    ):
        self.layout = layout
        self.num_experts = num_experts
        self._layers = dict(layers)  # layer index -> uint8 [E, nbytes of the layer's layout]
        self._layer_layouts = dict(layer_layouts or {})
        if any(lay.nbytes > layout.nbytes for lay in self._layer_layouts.values()):
            raise ValueError("The store's layout must be at least as wide as every layer's.")

    def layout_of(self, layer: int) -> ExpertLayout:
        """The layout of `layer`'s experts."""
        return self._layer_layouts.get(layer, self.layout)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of the largest packed expert: a device slot's size."""
        return self.layout.nbytes

    @property
    def layer_indices(self) -> list[int]:
        return sorted(self._layers)

    def layer_buffer(self, layer: int) -> torch.Tensor:
        """Every expert of `layer`, packed: uint8 `[E, nbytes]`."""
        return self._layers[layer]

    @property
    def device(self) -> torch.device:
        return next(iter(self._layers.values())).device

    def to(self, device: torch.device | str) -> ExpertStore:
        """This store on `device` (itself when it is there already)."""
        device = torch.device(device)
        if all(buf.device == device for buf in self._layers.values()):
            return self
        try:
            layers = {layer: buf.to(device) for layer, buf in self._layers.items()}
        except torch.OutOfMemoryError as err:
            raise DeviceOutOfMemoryError(
                f"Out of memory on {device} for a {self.nbytes / 2**30:.2f} GiB copy of the expert store. "
                "Use a lower-bit expert dtype or a smaller model."
            ) from err
        return ExpertStore(self.layout, layers, self.num_experts, self._layer_layouts)

    def buffer(self, layer: int, expert: int) -> torch.Tensor:
        return self._layers[layer][expert]

    def views(self, layer: int, expert: int) -> dict[str, torch.Tensor | GgmlWeight | Fp8Weight | Int4Weight]:
        return self.layout_of(layer).views(self._layers[layer][expert])

    @property
    def total_experts(self) -> int:
        return len(self._layers) * self.num_experts

    @property
    def nbytes(self) -> int:
        return sum(buf.numel() for buf in self._layers.values())

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


def allocate_layer(num_experts: int, nbytes: int, pin: bool, layer: int) -> torch.Tensor:
    """An empty `[E, nbytes]` layer buffer in host memory, pinned when asked, else on huge pages
    where the system gives them (engine.huge_pages: the CPU streams it every token)."""
    try:
        packed = torch.empty((num_experts, nbytes), dtype=torch.uint8, pin_memory=pin)
    except RuntimeError as err:
        raise DeviceOutOfMemoryError(
            f"Cannot allocate {nbytes * num_experts / 2**30:.1f} GiB of "
            f"{'pinned ' if pin else ''}host memory for layer {layer}'s experts ({err}). "
            "Close other programs or use a smaller model."
        ) from err
    if not pin:
        huge_pages.advise(packed)
    return packed


def pack_expert(
    fields: Mapping[str, torch.Tensor], views: Mapping[str, torch.Tensor], quant: QuantSpec | None
) -> None:
    """Write one expert's fields into its packed views: copied, or quantized where the layout says."""
    for name, tensor in fields.items():
        if name in views:
            views[name].copy_(tensor)
        else:
            quantize_into(tensor, views, name, quant)


def build_store(
    checkpoint: Checkpoint,
    disk_layout: DiskLayout,
    moe_layers: Mapping[int, str],
    expected_shapes: Mapping[str, tuple[int, ...]],
    num_experts: int,
    dtype: torch.dtype,
    pin: bool,
    progress: Callable[[int, int], None] | None = None,
    quant: QuantSpec | None = None,
) -> ExpertStore:
    """Pack every expert of `moe_layers` (layer index → on-disk prefix) into host memory.

    With `quant`, each expert's weight matrices are quantized as the expert is read."""
    native = ExpertLayout.from_shapes(expected_shapes, dtype)
    layout = native.quantized(quant) if quant is not None else native
    shapes = {f.name: f.shape for f in native.fields}
    layers: dict[int, torch.Tensor] = {}
    total, done = len(moe_layers) * num_experts, 0
    for layer, prefix in sorted(moe_layers.items()):
        packed = allocate_layer(num_experts, layout.nbytes, pin, layer)
        for expert in range(num_experts):
            fields = read_expert(checkpoint, disk_layout, prefix, expert, dtype)
            for name, tensor in fields.items():
                if tuple(tensor.shape) != shapes[name]:
                    raise CorruptCheckpointError(
                        f"Expert {expert} of {prefix.rstrip('.')} has {name} of shape {tuple(tensor.shape)}, "
                        f"but the config implies {shapes[name]}. The config and weights disagree."
                    )
            pack_expert(fields, layout.views(packed[expert]), quant)
            done += 1
            if progress is not None:
                progress(done, total)
        layers[layer] = packed
    return ExpertStore(layout, layers, num_experts)


def quantize_store(
    store: ExpertStore,
    spec: QuantSpec,
    progress: Callable[[int, int], None] | None = None,
    device: torch.device | str | None = None,
) -> ExpertStore:
    """A quantized copy of a native store, beside it (pinned if it is) or on `device`.

    Going to another device, each layer is quantized where the store is and then moved:
    the copy never exists whole in the store's memory."""
    layout = store.layout.quantized(spec)
    target = torch.device(device) if device is not None else store.device
    pin = store.device.type == "cpu" and target.type == "cpu" and store.pinned
    layers: dict[int, torch.Tensor] = {}
    total, done = store.total_experts, 0
    for layer in store.layer_indices:
        if store.device.type == "cpu":
            packed = allocate_layer(store.num_experts, layout.nbytes, pin, layer)
        else:
            packed = torch.empty((store.num_experts, layout.nbytes), dtype=torch.uint8, device=store.device)
        for expert in range(store.num_experts):
            pack_expert(store.views(layer, expert), layout.views(packed[expert]), spec)
            done += 1
            if progress is not None:
                progress(done, total)
        try:
            layers[layer] = packed.to(target)
        except torch.OutOfMemoryError as err:
            raise DeviceOutOfMemoryError(
                f"Out of memory on {target} for the {spec.name} copy of the experts "
                f"({layout.nbytes * store.total_experts / 2**30:.2f} GiB). Use fewer bits or a smaller model."
            ) from err
    return ExpertStore(layout, layers, store.num_experts)
