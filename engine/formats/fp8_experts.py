"""FP8 checkpoints as published (Qwen3-*-FP8, DeepSeek-V3): experts kept in FP8, the rest dequantized.

config.json says `quantization_config: {"quant_method": "fp8", "weight_block_size": [128, 128]}`;
each quantized Linear is `<name>.weight` (F8_E4M3, `(out, in)`) with `<name>.weight_scale_inv`
(F32, one scale per block, `engine.formats.fp8`). Without `weight_block_size` a weight has one
scale, `<name>.weight_scale`. compressed-tensors' FP8 (`engine.store.from_compressed_tensors`) names
its scales `weight_scale` too: one, one per row (`per_channel`, block `(1, in)`) or per block.
Norms, embeddings and routers stay in BF16.

Two readers of the same folder:
- `Fp8Checkpoint` wraps the `Checkpoint` for the resident weights: an FP8 weight reads as its
  dequantized floats (once, at load) and the scale tensors are hidden, so the loader sees what
  a BF16 release would give it.
- `build_fp8_store` packs each routed expert's e4m3 bytes and scales into an FP8 layout
  (`ExpertLayout.from_fp8`): the link carries FP8, dequantized only where computed. Per-expert
  `gate_proj`/`up_proj` become the field `gate_up_proj` (gate rows, then up rows) with their scale
  rows stacked alike; when the gate's rows end inside a block the field keeps one scale row per
  weight row instead (block `(1, b_in)`), which is exact too.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from engine.errors import (
    CorruptCheckpointError,
    MissingTensorsError,
    UnsupportedQuantizationError,
)
from engine.formats.fp8 import FP8_DTYPE, Fp8Weight, dequantize, scale_shape
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.checkpoint import Checkpoint
from engine.store.host_store import ExpertLayout, ExpertStore, allocate_layer
from engine.store.prequantized import (
    PackedCheckpoint,
    first_experts,
    per_expert_disk_layout,
    refuse_requantization,
)

FP8_NAME = "F8_E4M3"
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale")  # block scales; per-tensor or per-row scales
# static activation scales (FP8 with `input_scale`): the engine computes on dequantized weights
HIDDEN_SUFFIXES = (*SCALE_SUFFIXES, ".input_scale", ".input_zero_point")
WEIGHTS = ("gate_up_proj", "down_proj")
Progress = Callable[[str, int, int], None]  # (stage, done, total), as the loader reports


def fp8_block(hf_config) -> tuple[int, int] | None:
    """The scale block `(b_out, b_in)` of an FP8 checkpoint, None for per-tensor scales."""
    quant = getattr(hf_config, "quantization_config", None)
    get = quant.get if isinstance(quant, dict) else lambda key: getattr(quant, key, None)
    block = get("weight_block_size")
    return tuple(int(b) for b in block) if block else None


def is_fp8(hf_config) -> bool:
    """Whether the config says the checkpoint's Linear weights are FP8 (`quant_method: fp8`)."""
    quant = getattr(hf_config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method).lower() == "fp8"


def fp8_checkpoint(hf_config, checkpoint) -> tuple[object, object]:
    """The config and `checkpoint` as the loader reads it: wrapped in an `Fp8Checkpoint` when the
    model is FP8."""
    if is_fp8(hf_config):
        checkpoint = Fp8Checkpoint(checkpoint, fp8_block(hf_config))
    return hf_config, checkpoint


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


def build_fp8_store(
    checkpoint: Fp8Checkpoint,
    arch: Architecture,
    blocks: Mapping[int, tuple[str, torch.nn.Module]],
    pin: bool,
    expert_dtype: str,
    progress: Progress | None = None,
) -> tuple[ExpertStore, DiskLayout]:
    """Every routed expert of the MoE `blocks` (layer → (prefix, block)), kept in FP8."""
    refuse_requantization(checkpoint.folder.name, "in FP8", expert_dtype)
    disk_layout = per_expert_disk_layout(arch, "FP8")
    experts, shapes, num_experts = first_experts(blocks)
    if set(shapes) != set(WEIGHTS) or getattr(experts, "is_transposed", False):
        raise UnsupportedQuantizationError(
            f"FP8 experts of {arch.model_type} ({', '.join(shapes)}) are not supported: MoE Chat keeps "
            "FP8 experts of gate/up/down matrices without biases. Use the model's BF16 release."
        )
    parts = {name: len(disk_layout.sources[name]) for name in WEIGHTS}  # gate_up_proj: gate, up
    layout = ExpertLayout.from_fp8(
        (name, shapes[name], field_block(checkpoint, shapes[name], parts[name])) for name in WEIGHTS
    )
    layers, total = {}, len(blocks) * num_experts
    for done, (layer, (prefix, _)) in enumerate(sorted(blocks.items())):
        layers[layer] = allocate_layer(num_experts, layout.nbytes, pin, layer)
        for expert in range(num_experts):
            names = disk_layout.names(prefix + ".", expert)
            _pack_expert(checkpoint, names, shapes, layout.views(layers[layer][expert]))
        if progress is not None:
            progress("experts", (done + 1) * num_experts, total)
    return ExpertStore(layout, layers, num_experts), disk_layout


def _pack_expert(checkpoint: Fp8Checkpoint, names, shapes, views) -> None:
    """Write one expert's FP8 values and scales into its packed views, checked against the config."""
    for field, sources in names.items():
        out, columns = shapes[field]
        parts = [checkpoint.weight(name) for name in sources]
        for name, part in zip(sources, parts, strict=True):
            if tuple(part.data.shape) != (out // len(sources), columns):
                raise CorruptCheckpointError(
                    f"{name} is FP8 of shape {tuple(part.data.shape)}, but the config implies "
                    f"{(out // len(sources), columns)}. The config and weights disagree."
                )
        view = views[field]
        view.data.copy_(torch.cat([part.data for part in parts], dim=0))
        view.scale_inv.copy_(_field_scales(parts, view.block))
