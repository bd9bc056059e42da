"""Where a layer's experts lie and in which packing: a choice made apart from their format.

Contract: a placement turns the layout a format stores an expert in into the layout the store
holds (`layout`), allocates a layer's `[E, nbytes]` buffer (`allocate`) and gives the function
that writes one expert into its row (`writer`: the format's `pack`, then the conversion).
`AS_STORED` keeps every expert as its format stores it, in host memory. `CpuPlacement` is for
experts in ggml blocks (a GGUF file's, gpt-oss's MXFP4) computed on the CPU: each block field takes
the packing `repack.packing_for` names for the compute dtype and kernels (torch's int4/int8 CPU
kernels, or llama.cpp's), and a layer with fields in llama.cpp's interleaved rows lives in ggml's
own memory (`engine.ggml`). `GgmlFloats` is for a float checkpoint's experts computed by ggml on
the CPU: each weight matrix becomes ggml rows of the checkpoint's own float type (BF16 or F16, the
same numbers), `(out, in)` whatever the family's orientation; `Int4AsQ4_0` for a symmetric GPTQ
checkpoint's int4, as Q4_0 blocks code for code. `ggml_computes` says which checkpoints ggml
computes as they are; `quantized_placement` and `float_placement` choose for the loader.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from engine.errors import InvalidConfigError, UnsupportedQuantizationError
from engine.formats.base import ExpertFormat, ModelExperts
from engine.formats.fields import PLAIN, GgmlBlocks, Int4Words
from engine.formats.gguf.blocks import row_bytes
from engine.formats.gguf.experts import repacked_layout
from engine.formats.gguf.repack import GGML, GGML_X8, packing_for, place
from engine.formats.int4 import GPTQ, GPTQ_V2, to_q4_0
from engine.formats.int4_experts import INT4
from engine.formats.int_quant import is_weight
from engine.formats.layout import ExpertField, ExpertLayout
from engine.formats.mxfp4_experts import MXFP4
from engine.ggml import interleave as ggml_interleave
from engine.ggml import library as ggml_library
from engine.model.gguf_file import GgufCheckpoint
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
            _refuse_without_ggml()

    def layout(self, stored: ExpertLayout) -> ExpertLayout:
        return repacked_layout(
            stored,
            lambda blocks: packing_for(
                blocks.ggml_type, *blocks.shape, self.dtype, self.kernels, self.interleave
            ),
        )

    def allocate(self, layout: ExpertLayout, num_experts: int, pin: bool, layer: int) -> torch.Tensor:
        if not any(f.packing == GGML_X8 for f in layout.fields):
            return super().allocate(layout, num_experts, pin, layer)
        packed = ggml_interleave.allocate(num_experts * layout.nbytes, f"layer {layer}'s experts")
        return packed.view(num_experts, layout.nbytes)

    def writer(self, stored: ExpertLayout, layout: ExpertLayout) -> Writer:
        """The file's bytes straight into the row where the packing keeps them; else read into a
        one-expert buffer in the file's layout and placed field by field (`repack.place`)."""
        if all(f.packing in (None, GGML) for f in layout.fields):
            return super().writer(stored, layout)

        def place_blocks(f: ExpertField, target, source) -> None:
            blocks = f.format
            place(blocks.packing, target.data, source.data, blocks.ggml_type, *blocks.shape)

        return _staged(stored, layout, place_blocks)


# a float checkpoint's precision -> the ggml type holding its numbers as they are
GGML_FLOAT_TYPES = {torch.bfloat16: GGMLQuantizationType.BF16, torch.float16: GGMLQuantizationType.F16}


@dataclass(frozen=True)
class GgmlFloats(AsStored):
    """A float checkpoint's experts for ggml's kernels on the CPU (used where the store holds them,
    `engine.moe.layer`): each weight matrix as ggml rows of `stored_dtype` (the checkpoint's own
    BF16 or F16: read into a wider compute dtype, its numbers come back unchanged), `(out, in)`;
    a family holding `[in, out]` (`transposed`, gpt-oss) is transposed as it is written. Biases
    stay plain fields in the compute dtype."""

    stored_dtype: torch.dtype
    transposed: bool = False

    def __post_init__(self) -> None:
        if self.stored_dtype not in GGML_FLOAT_TYPES:
            raise ValueError(f"ggml keeps no experts in {self.stored_dtype}")
        _refuse_without_ggml()

    def layout(self, stored: ExpertLayout) -> ExpertLayout:
        fields = []
        ggml_type, itemsize = int(GGML_FLOAT_TYPES[self.stored_dtype]), self.stored_dtype.itemsize
        for f in stored.fields:
            if f.format is not PLAIN or not is_weight(f.shape):
                fields.append(f)
                continue
            out, columns = f.shape[::-1] if self.transposed else f.shape
            rows = GgmlBlocks(ggml_type, (out, columns), GGML)
            fields.append(ExpertField(f.name, (out, columns * itemsize), torch.uint8, 0, rows))
        return ExpertLayout.placed(fields)

    def writer(self, stored: ExpertLayout, layout: ExpertLayout) -> Writer:
        """Each expert read into a one-expert buffer in the model's layout, then each weight
        written as rows of `stored_dtype`."""

        def place_rows(f: ExpertField, target, weight: torch.Tensor) -> None:
            target.data.view(self.stored_dtype).copy_(weight.T if self.transposed else weight)

        return _staged(stored, layout, place_rows)


def _staged(stored: ExpertLayout, layout: ExpertLayout, place_weight: Callable[..., None]) -> Writer:
    """Each expert read into a one-expert buffer in the stored layout, then each field put in its
    row: a plain field (a bias) copied, a weight by `place_weight(field, target view, source view)`."""
    staging = torch.empty(stored.nbytes, dtype=torch.uint8)

    def write_placed(write: Write, row: torch.Tensor) -> None:
        source = stored.views(staging)
        write(source)
        target = layout.views(row)
        for f in layout.fields:
            if f.ggml_type is None:
                target[f.name].copy_(source[f.name])
            else:
                place_weight(f, target[f.name], source[f.name])

    return write_placed


def _refuse_without_ggml() -> None:
    ready, reason = ggml_library.available()
    if not ready:
        raise InvalidConfigError(f"--kernels ggml cannot run: {reason}. Use --kernels exact.")


def ggml_computes(expert_format: ExpertFormat, checkpoint) -> bool:
    """Whether ggml's CPU kernels compute this checkpoint's experts with the numbers it has: a GGUF
    file's blocks (and its matrices), gpt-oss's MXFP4 blocks, a BF16 or F16 checkpoint's floats,
    a symmetric GPTQ checkpoint's int4 as Q4_0 (`q4_0_exact`). Not FP8 (ggml has no such type; as
    BF16 its block scales would round) or AWQ and other asymmetric int4 (a zero point times its
    scale rounds in a Q4_1 block's float16 minimum): the exact kernels compute them."""
    if isinstance(checkpoint, GgufCheckpoint) or expert_format.name == MXFP4.name:
        return True
    if q4_0_exact(expert_format, checkpoint):
        return True
    return expert_format.name == "native" and checkpoint.storage_dtype() in GGML_FLOAT_TYPES


def q4_0_exact(expert_format: ExpertFormat, checkpoint) -> bool:
    """Whether the experts are int4 that ggml's Q4_0 holds code for code: GPTQ, symmetric (every zero
    point 8), without act-order (`int4.to_q4_0`)."""
    if expert_format.name != INT4.name:
        return False
    return checkpoint.format in (GPTQ, GPTQ_V2) and checkpoint.symmetric and not checkpoint.act_order


def quantized_placement(
    expert_format: ExpertFormat,
    checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    kernels: str,
    in_place: bool,
) -> AsStored:
    """Where a quantized format's experts lie: on the CPU, ggml blocks laid out for its kernels
    (`CpuPlacement`), or symmetric GPTQ int4 as Q4_0 rows where ggml computes (`Int4AsQ4_0`); else
    as the format stores them."""
    if device.type != "cpu":
        return AS_STORED
    if expert_format.repacks_for_cpu:
        return CpuPlacement(dtype, kernels, in_place)
    return Int4AsQ4_0() if kernels == "ggml" and q4_0_exact(expert_format, checkpoint) else AS_STORED


class Int4AsQ4_0(AsStored):
    """A symmetric GPTQ checkpoint's int4 experts as ggml Q4_0 rows of the same numbers, for ggml's
    kernels on the CPU: each int4 weight (its codes, zeros and scales) becomes one Q4_0 field
    (`int4.to_q4_0`: nothing rounds); other fields stay as they are."""

    def __init__(self) -> None:
        _refuse_without_ggml()

    def layout(self, stored: ExpertLayout) -> ExpertLayout:
        int4 = [f for f in stored.fields if isinstance(f.format, Int4Words)]
        companions = {name for f in int4 for name in f.format.companions(f.name)}
        fields = []
        for f in stored.fields:
            if isinstance(f.format, Int4Words):
                out, columns = f.format.shape
                rows = GgmlBlocks(int(GGMLQuantizationType.Q4_0), (out, columns), GGML)
                per_row = row_bytes(GGMLQuantizationType.Q4_0, columns)
                fields.append(ExpertField(f.name, (out, per_row), torch.uint8, 0, rows))
            elif f.name not in companions:
                fields.append(f)
        return ExpertLayout.placed(fields)

    def writer(self, stored: ExpertLayout, layout: ExpertLayout) -> Writer:
        def place_q4_0(f: ExpertField, target, weight) -> None:
            rows = to_q4_0(weight)
            if rows is None:
                raise UnsupportedQuantizationError(
                    f"{f.name} is not symmetric int4 in whole groups of 32 as its config says (sym: true): "
                    "the checkpoint and its config disagree. Use --kernels exact."
                )
            target.data.copy_(rows)

        return _staged(stored, layout, place_q4_0)


def float_placement(
    kernels: str, device: torch.device, stored_dtype: torch.dtype, model: ModelExperts
) -> AsStored:
    """Where a float checkpoint's experts lie: as ggml rows (`GgmlFloats`) where ggml computes
    them on the CPU and the compute dtype holds the checkpoint's numbers unchanged; else as read."""
    computes = kernels == "ggml" and device.type == "cpu" and stored_dtype in GGML_FLOAT_TYPES
    if not computes or model.dtype not in (stored_dtype, torch.float32):
        return AS_STORED
    return GgmlFloats(stored_dtype, model.transposed)
