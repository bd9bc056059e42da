"""What a fused MoE kernel reads of one projection (`gate_up_proj`, `down_proj`) of every expert in
the device cache's pool, one object per stored type: where its fields lie in a pool row (the
`ExpertLayout`'s offsets), the weight's `(rows, columns)`, and the kernels that read it.

Contract: `projection(layout, name)` is the projection object of field `name` of `layout`, or a
sentence saying why no kernel reads it. Every family takes its projection's fields as one run of
ints after the pool row's size (`ints`), so that a launch is the same for every stored type:

    moe_gate_up(x, pool, table, ids, act, expert_nbytes, *ints, inter, hidden)
    moe_down(act, pool, table, ids, weights, out, expert_nbytes, *ints, hidden, inter, top_k)

with the family's `constexprs` (a JIT launch), or as the cubin `cubin(kernel, x_dtype)` built with
them. `module` is the family's Triton module, `label` names its launches (`launch_range`), and
`block_n` is the rows a program of its cubins computes. Importing this module imports no triton:
the cubins run where triton is not installed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
from gguf import GGMLQuantizationType

from engine.formats.fields import Fp8Blocks, GgmlBlocks, Int4Words
from engine.formats.fp8 import scale_shape
from engine.formats.int4 import FORMATS as INT4_FORMATS
from engine.formats.int4 import PACK, ROW_MAJOR, packed_shapes
from engine.formats.layout import ExpertField, ExpertLayout
from engine.gpu.registry import (
    FIELD_ALIGN,
    FP8_BLOCK_N,
    INT4_BLOCK_N,
    KQUANT_BLOCK_N,
    KQUANT_TYPES,
    fp8_name,
    int4_name,
    int4_variant,
    kquant_name,
)

LANES = 32  # columns the FP8 and int4 kernels read under one scale

KQUANT_NAMES = ", ".join(GGMLQuantizationType(t).name for t in KQUANT_TYPES)  # what the K-quant family reads


class Projection(Protocol):
    """What every family's projection object tells its launches (see the module doc)."""

    rows: int
    columns: int
    module: str
    block_n: int
    label: str
    ints: tuple[int, ...]
    constexprs: dict[str, int | bool]
    offsets: tuple[int, ...]  # its fields' byte offsets in a pool row

    def cubin(self, kernel: str, x_dtype: str) -> str: ...


@dataclass(frozen=True)
class KQuantProjection:
    """GGUF blocks of a type in `KQUANT_TYPES` as the store keeps them (`engine.gpu.kquant_moe`)."""

    offset: int
    ggml_type: int
    rows: int
    columns: int
    module, block_n = "engine.gpu.kquant_moe", KQUANT_BLOCK_N

    @classmethod
    def of(cls, fields: dict[str, ExpertField], name: str) -> KQuantProjection | str:
        field = fields[name]
        if field.packing is not None:
            return f"{name} is repacked for the CPU's kernels ({field.packing})"
        if field.ggml_type not in KQUANT_TYPES:
            return f"{name} is {field.format.label}: the fused kernels read {KQUANT_NAMES}"
        return cls(field.offset, int(field.ggml_type), *field.format.shape)

    @property
    def label(self) -> str:
        return GGMLQuantizationType(self.ggml_type).name.lower()

    @property
    def ints(self) -> tuple[int, ...]:
        return (self.offset,)

    @property
    def constexprs(self) -> dict[str, int | bool]:
        return {"GGML_TYPE": self.ggml_type}

    @property
    def offsets(self) -> tuple[int, ...]:
        return (self.offset,)

    def cubin(self, kernel: str, x_dtype: str) -> str:
        return kquant_name(kernel, self.ggml_type, x_dtype)


@dataclass(frozen=True)
class Fp8Projection:
    """e4m3 values `(rows, columns)` and their float32 scale_inv, one a `block` of
    `(block_rows, block_cols)` values (`engine.gpu.fp8_moe`)."""

    offset: int
    scale_offset: int
    rows: int
    columns: int
    block: tuple[int, int]
    module, block_n, label = "engine.gpu.fp8_moe", FP8_BLOCK_N, "fp8"

    @classmethod
    def of(cls, fields: dict[str, ExpertField], name: str) -> Fp8Projection | str:
        field, scales = fields[name], fields.get(f"{name}.scale_inv")
        (rows, columns), block = field.shape, tuple(field.format.block)
        if block[1] % LANES and block[1] < columns:
            return f"{name}'s FP8 scales are {block[1]} columns wide: the kernels read {LANES} under one"
        if scales is None or scales.dtype != torch.float32 or scales.shape != scale_shape(field.shape, block):
            return f"{name}'s FP8 scales are not float32 {scale_shape(field.shape, block)} (scale_inv)"
        return cls(field.offset, scales.offset, rows, columns, block)

    @property
    def ints(self) -> tuple[int, ...]:
        return (self.offset, self.scale_offset, *self.block)

    @property
    def constexprs(self) -> dict[str, int | bool]:
        return {}

    @property
    def offsets(self) -> tuple[int, ...]:
        return (self.offset, self.scale_offset)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Each field's (byte offset, bytes) in a pool row."""
        scales = 4 * math.prod(scale_shape((self.rows, self.columns), self.block))
        return ((self.offset, self.rows * self.columns), (self.scale_offset, scales))

    def cubin(self, kernel: str, x_dtype: str) -> str:
        return fp8_name(kernel, x_dtype)


@dataclass(frozen=True)
class Int4Projection:
    """GPTQ, AWQ or compressed-tensors int32 words of a `(rows, columns)` weight with their zeros,
    float16/bfloat16 scales in groups of `group_size` inputs and, for act-order, g_idx rows, each
    serving `part_rows` rows (`engine.gpu.int4_moe`)."""

    format: str  # one of engine.formats.int4.FORMATS
    offset: int
    qzeros_offset: int
    scales_offset: int
    g_idx_offset: int | None  # None: the groups are in input order (no act-order)
    rows: int
    columns: int
    group_size: int
    part_rows: int
    scales_bf16: bool
    module, block_n = "engine.gpu.int4_moe", INT4_BLOCK_N

    @classmethod
    def of(cls, fields: dict[str, ExpertField], name: str) -> Int4Projection | str:
        field = fields[name]
        fmt, (rows, columns) = field.format.format, field.format.shape
        qzeros, scales, g_idx = (fields.get(c) for c in field.format.companions(name))
        if scales.dtype not in (torch.float16, torch.bfloat16):
            return f"{name}'s int4 scales are {scales.dtype}: the kernels read float16 and bfloat16"
        groups = scales.shape[1 if fmt in ROW_MAJOR else 0]
        group_size = columns // groups
        if g_idx is None and groups > 1 and group_size % LANES:
            return f"{name}'s int4 groups are {group_size} inputs: the kernels read {LANES} under one scale"
        if columns % PACK:
            return f"{name} has {columns} inputs, not whole int32 words of {PACK}"
        part_rows = rows if g_idx is None else rows // g_idx.shape[0]
        g_idx_offset = None if g_idx is None else g_idx.offset
        zeros, bf16 = qzeros.offset, scales.dtype == torch.bfloat16
        return cls(
            fmt, field.offset, zeros, scales.offset, g_idx_offset, rows, columns, group_size, part_rows, bf16
        )

    @property
    def act_order(self) -> bool:
        return self.g_idx_offset is not None

    @property
    def label(self) -> str:
        return int4_variant(self.format, self.act_order)

    @property
    def ints(self) -> tuple[int, ...]:
        g_idx, sizes = self.g_idx_offset or 0, (self.part_rows, self.group_size, int(self.scales_bf16))
        return (self.offset, self.qzeros_offset, self.scales_offset, g_idx, *sizes)

    @property
    def constexprs(self) -> dict[str, int | bool]:
        return {"FORMAT": INT4_FORMATS.index(self.format), "ACT_ORDER": self.act_order}

    @property
    def offsets(self) -> tuple[int, ...]:
        return (self.offset, self.qzeros_offset, self.scales_offset, self.g_idx_offset or 0)

    @property
    def spans(self) -> tuple[tuple[int, int], ...]:
        """Each field's (byte offset, bytes) in a pool row."""
        shapes = packed_shapes(self.format, (self.rows, self.columns), self.columns // self.group_size)
        spans = [
            (self.offset, 4 * math.prod(shapes["qweight"])),
            (self.qzeros_offset, 4 * math.prod(shapes["qzeros"])),
        ]
        spans.append((self.scales_offset, 2 * math.prod(shapes["scales"])))
        if self.act_order:
            spans.append((self.g_idx_offset, 4 * (self.rows // self.part_rows) * self.columns))
        return tuple(spans)

    def cubin(self, kernel: str, x_dtype: str) -> str:
        return int4_name(kernel, self.format, self.act_order, x_dtype)


READERS = {GgmlBlocks: KQuantProjection, Fp8Blocks: Fp8Projection, Int4Words: Int4Projection}


def projection(layout: ExpertLayout, name: str) -> Projection | str:
    """The projection `name` of `layout` as a kernel family reads it, or why none does."""
    fields = {f.name: f for f in layout.fields}
    field = fields[name]
    reader = READERS.get(type(field.format))
    if reader is None:
        return f"{name} is {field.format.label}, not GGUF blocks, FP8 values or int4 words"
    found = reader.of(fields, name)
    if not isinstance(found, str) and any(offset % FIELD_ALIGN for offset in found.offsets):
        return f"{name} does not start on a {FIELD_ALIGN}-byte boundary"
    return found
