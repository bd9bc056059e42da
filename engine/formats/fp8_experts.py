"""FP8 checkpoints as published (Qwen3-*-FP8, DeepSeek-V3): experts kept in FP8, the rest dequantized.

config.json says `quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}`;
each quantized Linear is `<name>.weight` (F8_E4M3, `(out, in)`) with `<name>.weight_scale_inv`
(F32, one scale per block, `engine.formats.fp8`). Without `weight_block_size` a weight has one
scale, `<name>.weight_scale`. compressed-tensors' FP8 (`engine.formats.compressed_tensors`) names
its scales `weight_scale` too: one, one per row (`per_channel`, block `(1, in)`) or per block.
Norms, embeddings and routers stay in BF16.

Two readers of the same folder:
- `Fp8Checkpoint` wraps the `Checkpoint` for the resident weights: an FP8 weight reads as its
  dequantized floats (once, at load) and the scale tensors are hidden, so the loader sees what
  a BF16 release would give it.
- `Fp8Experts` packs each routed expert's e4m3 bytes and scales into an FP8 layout (`fp8_layout`):
  the link carries FP8, dequantized only where computed. Per-expert `gate_proj`/`up_proj` become
  the field `gate_up_proj` (gate rows, then up rows) with their scale rows stacked alike; when the
  gate's rows end inside a block the field keeps one scale row per weight row instead (block
  `(1, b_in)`), which is exact too.

`FP8` is the format: it detects `quant_method: fp8` and compressed-tensors' `float-quantized`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.errors import CorruptCheckpointError, MissingTensorsError
from engine.formats.base import ModelExperts
from engine.formats.compressed_tensors import compressed_weights, fp8_scales, is_float
from engine.formats.fields import Fp8Blocks
from engine.formats.fp8 import FP8_DTYPE, Fp8Weight, dequantize, scale_shape
from engine.formats.layout import ExpertField, ExpertLayout
from engine.formats.packed_checkpoint import (
    WEIGHTS,
    PackedCheckpoint,
    per_expert_matrices,
    quantization_config,
)
from engine.model.checkpoint import Checkpoint

FP8_NAME = "F8_E4M3"
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # block scales; per-tensor or per-row scales
# static activation scales (FP8 with `input_scale`): the engine computes on dequantized weights
HIDDEN_SUFFIXES = (*SCALE_SUFFIXES, ".input_scale", ".input_zero_point")


def fp8_block(hf_config) -> tuple[int, int] | None:
    """The scale block `(b_out, b_in)` of an FP8 checkpoint, None for per-tensor scales."""
    block = quantization_config(hf_config).get("weight_block_size")
    return tuple(int(b) for b in block) if block else None


def is_fp8(hf_config) -> bool:
    """Whether the config says the checkpoint's Linear weights are FP8 (`quant_method: fp8`)."""
    return str(quantization_config(hf_config).get("quant_method")).lower() == "fp8"


def fp8_layout(fields: Iterable[tuple[str, tuple[int, int], tuple[int, int]]]) -> ExpertLayout:
    """Fields `(name, (out, in), (b_out, b_in))` kept in FP8: e4m3 values, then float32 scales."""
    placed = []
    for name, (out, columns), block in fields:
        placed.append(ExpertField(name, (out, columns), FP8_DTYPE, 0, Fp8Blocks(tuple(block))))
        placed.append(ExpertField(f"{name}.scale_inv", scale_shape((out, columns), block), torch.float32, 0))
    return ExpertLayout.placed(placed)


class Fp8Checkpoint(PackedCheckpoint):
    """A `Checkpoint` whose FP8 weights read as floats and whose scale tensors are hidden."""

    def __init__(self, checkpoint: Checkpoint, block: tuple[int, int] | None, per_channel: bool = False):
        # every tensor FP8 but its scales: BF16 is what the release computes in
        super().__init__(checkpoint, hidden={n for n in checkpoint if n.endswith(HIDDEN_SUFFIXES)})
        self.block, self.per_channel = block, per_channel

    def matrix_block(self, shape: tuple[int, int]) -> tuple[int, int]:
        """The scale block of one `(out, in)` matrix: the config's block, a row (per-channel scales)
        or the whole matrix (one scale)."""
        if self.per_channel:
            return (1, shape[1])
        return self.block or tuple(shape)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`; an FP8 weight dequantized with its scales, in `dtype` (float32 if None)."""
        if self.packed.dtype_name(name) != FP8_NAME:
            return self.packed.read(name, dtype)
        return dequantize(self.weight(name), dtype or torch.float32)

    def weight(self, name: str) -> Fp8Weight:
        """The FP8 weight `name` as stored: e4m3 values `(out, in)` and their float32 scales."""
        stored = self.packed.dtype_name(name)
        if stored != FP8_NAME:
            raise CorruptCheckpointError(
                f"{name} is stored as {stored}, but config.json says the checkpoint is FP8 "
                "(quant_method fp8): the config and weights disagree. Use the config that came with them."
            )
        data = self.packed.read(name, FP8_DTYPE)
        if data.dim() != 2:
            raise CorruptCheckpointError(f"{name} is FP8 of shape {tuple(data.shape)}, not a matrix.")
        if f"{name}_scale_inv" in self.packed:
            scale, block = self.packed.read(f"{name}_scale_inv", torch.float32), self.block or (128, 128)
        elif f"{name}_scale" in self.packed:  # one scale, one per row, or compressed-tensors' blocks
            scale = self.packed.read(f"{name}_scale", torch.float32)
            block = tuple(data.shape) if scale.numel() == 1 else self.matrix_block(tuple(data.shape))
            scale = scale.reshape(1, 1) if scale.numel() == 1 else scale
        else:
            raise MissingTensorsError(
                f"The FP8 weight {name} has no {name}_scale_inv or {name}_scale in {self.folder}. "
                "The download is incomplete; download the model again."
            )
        expected = scale_shape(tuple(data.shape), block)
        if tuple(scale.shape) != expected:
            raise CorruptCheckpointError(
                f"The scales of {name} {tuple(data.shape)} are {tuple(scale.shape)}, but blocks of "
                f"{block} make {expected}: the config and weights disagree. Download the model again."
            )
        return Fp8Weight(data, scale, block)


def field_block(checkpoint: Fp8Checkpoint, shape: tuple[int, int], parts: int) -> tuple[int, int]:
    """The scale block of a field of `shape` `(out, in)` made of `parts` equal matrices stacked."""
    part_out = shape[0] // parts
    block = checkpoint.matrix_block((part_out, shape[1]))
    return block if parts == 1 or part_out % block[0] == 0 else (1, block[1])


def _field_scales(parts: list[Fp8Weight], block: tuple[int, int]) -> torch.Tensor:
    """The parts' scales stacked as the field's `block` has them (per row when blocks straddle parts)."""
    scales = []
    for part in parts:
        rows = part.scale_inv
        if part.block[0] != block[0]:  # one scale row per weight row
            rows = rows.repeat_interleave(part.block[0], 0)[: part.data.shape[0]]
        scales.append(rows)
    return torch.cat(scales, dim=0)


class Fp8Experts:
    """An FP8 checkpoint's experts, each expert's matrices read apart and packed in FP8."""

    def __init__(self, checkpoint: Fp8Checkpoint, model: ModelExperts):
        self.checkpoint, self.model = checkpoint, model
        self.disk_layout = disk_layout = per_expert_matrices(model, "FP8", "FP8")
        self.name, shapes = disk_layout.name, model.shapes
        parts = {name: len(disk_layout.sources[name]) for name in WEIGHTS}  # gate_up_proj: gate, up
        self._layout = fp8_layout(
            (name, shapes[name], field_block(checkpoint, shapes[name], parts[name])) for name in WEIGHTS
        )

    def layer_layout(self, layer: int) -> ExpertLayout:
        return self._layout

    def pack(self, layer: int, expert: int, views) -> None:
        """Write one expert's FP8 values and scales into its packed views, checked against the config."""
        for field, sources in self.disk_layout.names(self.model.prefixes[layer] + ".", expert).items():
            out, columns = self.model.shapes[field]
            parts = [self.checkpoint.weight(name) for name in sources]
            for name, part in zip(sources, parts, strict=True):
                if tuple(part.data.shape) != (out // len(sources), columns):
                    raise CorruptCheckpointError(
                        f"{name} is FP8 of shape {tuple(part.data.shape)}, but the config implies "
                        f"{(out // len(sources), columns)}. The config and weights disagree."
                    )
            view = views[field]
            view.data.copy_(torch.cat([part.data for part in parts], dim=0))
            view.scale_inv.copy_(_field_scales(parts, view.block))


class Fp8Format:
    """FP8 experts with their block, row or tensor scales."""

    name, kept_quantized, repacks_for_cpu = "fp8", True, False

    def detect(self, hf_config, checkpoint) -> bool:
        return is_fp8(hf_config) or is_float(compressed_weights(hf_config, checkpoint))

    def reader(self, hf_config, checkpoint: Checkpoint) -> Fp8Checkpoint:
        weights = compressed_weights(hf_config, checkpoint)
        if weights is not None:
            return Fp8Checkpoint(checkpoint, *fp8_scales(weights))
        return Fp8Checkpoint(checkpoint, fp8_block(hf_config))

    def kept_as(self, checkpoint: Fp8Checkpoint) -> tuple[str, str]:
        return checkpoint.folder.name, "in FP8"

    def open(self, checkpoint: Fp8Checkpoint, model: ModelExperts) -> Fp8Experts:
        return Fp8Experts(checkpoint, model)


FP8 = Fp8Format()
