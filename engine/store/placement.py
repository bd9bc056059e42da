"""Where a layer's experts lie and in which packing: a choice made apart from their format.

Contract: a placement turns the layout a format stores an expert in into the layout the store
holds (`layout`), allocates a layer's `[E, nbytes]` buffer (`allocate`) and gives the function
that writes one expert into its row (`writer`: the format's `pack`, then the conversion).
`AS_STORED` keeps every expert as its format stores it, in host memory. `CpuPlacement` is for a
GGUF file's experts computed on the CPU: each field takes the packing `repack.packing_for`
names for the compute dtype and kernels (torch's int4/int8 CPU kernels, or llama.cpp's), and a
layer with fields in llama.cpp's interleaved rows lives in ggml's own memory (`engine.ggml`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from engine.errors import InvalidConfigError
from engine.formats.gguf.experts import repacked_layout
from engine.formats.gguf.repack import GGML, GGML_X8, packing_for, place
from engine.formats.layout import ExpertLayout
from engine.ggml import interleave as ggml_interleave
from engine.ggml import library as ggml_library
from engine.store.host_store import allocate_layer

Write = Callable[[Mapping[str, object]], None]  # fills the views of one expert in the stored layout
Writer = Callable[[Write, torch.Tensor], None]  # (write, the expert's row of the layer buffer)


class AsStored:
    """Every expert as its format stores it, in host memory (`allocate_layer`)."""

    def layout(self, stored: ExpertLayout) -> ExpertLayout:
        return stored

    def allocate(self, layout: ExpertLayout, num_experts: int, pin: bool, layer: int) -> torch.Tensor:
        return allocate_layer(num_experts, layout.nbytes, pin, layer)

    def writer(self, stored: ExpertLayout, layout: ExpertLayout) -> Writer:
        return lambda write, row: write(layout.views(row))


AS_STORED = AsStored()


@dataclass(frozen=True)
class CpuPlacement(AsStored):
    """GGUF experts laid out for the CPU computing in `dtype` with `kernels`; `interleave`: the
    experts are used where the store holds them, so ggml may read them in its interleaved rows."""

    dtype: torch.dtype
    kernels: str = "exact"
    interleave: bool = False

    def __post_init__(self) -> None:
        if self.kernels == "ggml":
            ready, reason = ggml_library.available()
            if not ready:
                raise InvalidConfigError(f"--kernels ggml cannot run: {reason}. Use --kernels exact.")

    def layout(self, stored: ExpertLayout) -> ExpertLayout:
        return repacked_layout(
            stored,
            lambda blocks: packing_for(
                blocks.ggml_type, *blocks.shape, self.dtype, self.kernels, self.interleave
            ),
        )

    def allocate(self, layout: ExpertLayout, num_experts: int, pin: bool, layer: int) -> torch.Tensor:
        if not any(f.format.packing == GGML_X8 for f in layout.fields):
            return super().allocate(layout, num_experts, pin, layer)
        packed = ggml_interleave.allocate(num_experts * layout.nbytes, f"layer {layer}'s experts")
        return packed.view(num_experts, layout.nbytes)

    def writer(self, stored: ExpertLayout, layout: ExpertLayout) -> Writer:
        """The file's bytes straight into the row where the packing keeps them; else read into a
        one-expert buffer in the file's layout and placed field by field (`repack.place`)."""
        if all(f.format.packing in (None, GGML) for f in layout.fields):
            return super().writer(stored, layout)
        staging = torch.empty(stored.nbytes, dtype=torch.uint8)

        def write_placed(write: Write, row: torch.Tensor) -> None:
            source = stored.views(staging)
            write(source)
            target = layout.views(row)
            for f in layout.fields:
                blocks = f.format
                place(
                    blocks.packing, target[f.name].data, source[f.name].data, blocks.ggml_type, *blocks.shape
                )

        return write_placed
