"""Host-memory store of every routed expert: one contiguous `[E, nbytes]` buffer a MoE layer.

Contract: an `ExpertStore` holds, per MoE layer, one uint8 row an expert, packed as its layer's
`ExpertLayout` says (`engine.formats.layout`), so moving an expert to the device is exactly one
copy; `views` gives an expert's typed weights. Layer buffers live in pageable host memory (on huge
pages where the system gives them: the CPU streams them every token), pinned when asked so copies
to CUDA run asynchronously at full link speed. `ExpertStore.to` puts a store on a device (SubSpec's
resident low-bit substitutes); `quantize_store` makes a group-wise int8/int4 copy of a native store
(`engine.formats.int_quant`). Stores are built by `engine.store.build`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine import huge_pages
from engine.errors import DeviceOutOfMemoryError
from engine.formats.fields import Weight
from engine.formats.int_quant import QuantSpec
from engine.formats.layout import ExpertLayout
from engine.formats.native_experts import pack_expert


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

    def views(self, layer: int, expert: int) -> dict[str, Weight]:
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
