"""Where each field of one expert lies in its packed buffer, and in which format.

Contract: an expert's fields (`gate_up_proj`, `down_proj`, biases, a format's scales …) are packed
back to back, each on an `ALIGN`-byte boundary, in one byte buffer an `ExpertLayout` describes, so
moving an expert to the device is one copy. Each `ExpertField` carries its `FieldFormat`
(`engine.formats.fields`), and `views` gives the typed weights of a buffer by asking each field's
format: the layout itself knows no format. `quant` marks a layout of the engine's own group-wise
int8/int4 fields (`engine.formats.int_quant`), which `quantized` makes from a native one.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from engine.formats.fields import PLAIN, FieldFormat, Weight
from engine.formats.int_quant import QuantSpec, is_weight, quantized_fields

ALIGN = 64  # bytes; keeps every field aligned for vectorised kernels and dtype views


@dataclass(frozen=True)
class ExpertField:
    name: str
    shape: tuple[int, ...]  # of the stored array (a ggml field: rows × bytes per row)
    dtype: torch.dtype
    offset: int  # bytes from the start of the expert's buffer
    format: FieldFormat = PLAIN

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    # A ggml field's traits, None on a field of any other format: MoE execution's ggml path reads
    # them off the field (engine.moe.layer).
    @property
    def ggml_type(self) -> int | None:
        return getattr(self.format, "ggml_type", None)

    @property
    def weight_shape(self) -> tuple[int, int] | None:
        """The `(out, in)` weight a ggml or int4 field holds."""
        return getattr(self.format, "shape", None)

    @property
    def packing(self) -> str | None:
        return getattr(self.format, "packing", None)


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
        """Plain fields `(name, shape, dtype)` back to back, each starting on an `ALIGN`-byte boundary."""
        return cls.placed([ExpertField(name, tuple(shape), dtype, 0) for name, shape, dtype in fields], quant)

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]], dtype: torch.dtype) -> ExpertLayout:
        return cls.from_fields((name, shape, dtype) for name, shape in shapes.items())

    @classmethod
    def placed(cls, fields: Iterable[ExpertField], quant: QuantSpec | None = None) -> ExpertLayout:
        """`fields` in order, each at the next `ALIGN`-byte boundary (their own offsets ignored)."""
        placed, offset = [], 0
        for field in fields:
            placed.append(dataclasses.replace(field, offset=offset))
            offset += -(-field.nbytes // ALIGN) * ALIGN
        return cls(tuple(placed), offset, quant)

    @property
    def format_name(self) -> str:
        """How the layout holds its experts: `native`, the engine's `int8`/`int4`, or the formats of
        its fields (`fp8`, `int4 (gptq)`, a GGUF file's types such as `Q4_K/Q6_K`)."""
        if self.quant is not None:
            return self.quant.name
        formats = {f.format.label: f.format.order for f in self.fields if f.format is not PLAIN}
        return "/".join(sorted(formats, key=formats.get)) or "native"

    def quantized(self, spec: QuantSpec) -> ExpertLayout:
        """This native layout with every weight matrix replaced by its quantized fields."""
        if self.quant is not None:
            raise ValueError(f"The layout is already quantized ({self.quant.name}).")
        if self.format_name != "native":
            raise ValueError(f"The layout holds {self.format_name} experts: they are quantized already.")
        fields = []
        for f in self.fields:
            if is_weight(f.shape):
                fields += quantized_fields(f.name, f.shape, spec, f.dtype)
            else:
                fields.append((f.name, f.shape, f.dtype))
        return ExpertLayout.from_fields(fields, spec)

    @functools.cached_property
    def _weights(self) -> tuple[ExpertField, ...]:
        """The fields that give a weight: every field but those another one takes in."""
        taken = {name for f in self.fields for name in f.format.companions(f.name)}
        return tuple(f for f in self.fields if f.name not in taken)

    def views(self, buffer: torch.Tensor) -> dict[str, Weight]:
        """The weights of one packed expert buffer (uint8, at least `nbytes` long), by field name: a
        tensor view, or the weight object its field's format makes of its fields' views."""
        plain = {
            f.name: buffer[f.offset : f.offset + f.nbytes].view(f.dtype).view(f.shape) for f in self.fields
        }
        return {f.name: f.format.weight(f.name, plain) for f in self._weights}
