"""The formats one stored field can be in: each an object that knows the weight the field's views give.

Contract: every field of an `ExpertLayout` carries a `FieldFormat`. `ExpertLayout.views` makes a
plain tensor view of every field, then asks each field's format for its weight: the format names
the fields it takes in (`companions`: an FP8 field's scales, an int4 field's zeros and scales) and
builds the weight from them (`weight`). One entry per format, as ggml's `type_traits` has one per
type; nothing else in the engine branches on which format a field is in.

- `PLAIN`: the field's own tensor (native floats, biases, the engine's int8/int4 codes, scales and
  offsets, and every companion field);
- `GgmlBlocks(ggml_type, shape, packing)`: ggml blocks of an `(out, in)` weight, as a GGUF file
  has them or repacked for the CPU (`engine.formats.gguf.repack`) → `GgmlWeight`;
- `Fp8Blocks(block)`: e4m3 values `(out, in)` with the float32 field `<name>.scale_inv` →
  `Fp8Weight` (`engine.formats.fp8`);
- `Int4Words(format, shape)`: GPTQ/AWQ/compressed-tensors int32 words with the fields
  `<name>.qzeros`, `<name>.scales` and, for act-order, `<name>.g_idx` → `Int4Weight`
  (`engine.formats.int4`).

`label` names the format where a model says how it holds its experts (`ExpertLayout.format_name`);
`order` sorts labels (a GGUF file's types as llama.cpp numbers them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from gguf import GGMLQuantizationType

from engine.formats.fp8 import Fp8Weight
from engine.formats.gguf.blocks import linear as ggml_linear
from engine.formats.gguf.repack import GGML_PACKINGS, repacked_linear
from engine.formats.int4 import Int4Weight
from engine.ggml import kernels as ggml_kernels


class GgmlWeight(NamedTuple):
    """The view of a ggml field: its blocks, their type, and the `(out, in)` weight they hold."""

    data: torch.Tensor  # uint8 [out, bytes per row]
    ggml_type: int
    shape: tuple[int, int]
    packing: str | None = None  # repacked at load for the CPU (`engine.formats.gguf.repack`)

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        """`x @ W.T`: how `engine.formats.int_quant.linear` computes this format."""
        if self.packing in GGML_PACKINGS:  # interleaved rows too: ggml knows them by their memory
            return ggml_kernels.linear(x, self.data, self.ggml_type, *self.shape)
        if self.packing is not None:
            return repacked_linear(self.packing, x, self.data, *self.shape)
        return ggml_linear(x, self.data, self.ggml_type, *self.shape)


# what a field gives: a tensor, or a weight object that computes `x @ W.T` itself (`linear`)
Weight = torch.Tensor | GgmlWeight | Fp8Weight | Int4Weight


@runtime_checkable
class FieldFormat(Protocol):
    """What a field's bytes are, and the weight its views give."""

    label: str
    order: int

    def companions(self, name: str) -> tuple[str, ...]:
        """The fields the weight of field `name` takes in besides its own (they give no weight)."""
        ...

    def weight(self, name: str, views: Mapping[str, torch.Tensor]) -> Weight:
        """The weight of field `name` from the plain views of every field of the expert."""
        ...


class PlainTensor:
    """A field that is its own tensor."""

    label, order = "native", 0

    def companions(self, name: str) -> tuple[str, ...]:
        return ()

    def weight(self, name: str, views: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return views[name]


PLAIN = PlainTensor()


@dataclass(frozen=True)
class GgmlBlocks:
    """An `(out, in)` weight in ggml blocks of `ggml_type`, rows of blocks (repacked: `packing`)."""

    ggml_type: int
    shape: tuple[int, int]
    packing: str | None = None

    @property
    def label(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name

    @property
    def order(self) -> int:
        return int(self.ggml_type)

    def companions(self, name: str) -> tuple[str, ...]:
        return ()

    def weight(self, name: str, views: Mapping[str, torch.Tensor]) -> GgmlWeight:
        return GgmlWeight(views[name], self.ggml_type, self.shape, self.packing)


@dataclass(frozen=True)
class Fp8Blocks:
    """An `(out, in)` FP8 weight whose scales, one per `block`, are the field `<name>.scale_inv`."""

    block: tuple[int, int]
    label, order = "fp8", 0

    def companions(self, name: str) -> tuple[str, ...]:
        return (f"{name}.scale_inv",)

    def weight(self, name: str, views: Mapping[str, torch.Tensor]) -> Fp8Weight:
        return Fp8Weight(views[name], views[f"{name}.scale_inv"], self.block)


@dataclass(frozen=True)
class Int4Words:
    """The qweight of an `(out, in)` int4 weight in `format`, with its `.qzeros`, `.scales` (and
    `.g_idx`) fields."""

    format: str
    shape: tuple[int, int]
    order = 0

    @property
    def label(self) -> str:
        return f"int4 ({self.format})"

    def companions(self, name: str) -> tuple[str, ...]:
        return (f"{name}.qzeros", f"{name}.scales", f"{name}.g_idx")

    def weight(self, name: str, views: Mapping[str, torch.Tensor]) -> Int4Weight:
        qzeros, scales, g_idx = (views.get(companion) for companion in self.companions(name))
        return Int4Weight(views[name], qzeros, scales, g_idx, self.format, self.shape)
