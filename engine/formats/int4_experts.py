"""GPTQ/AWQ and compressed-tensors int4 experts, kept in the checkpoint's own int32 words.

Each routed expert's qweight/qzeros/scales (and `g_idx` rows when the config says act-order) are
packed into an int4 layout (`int4_layout`): the link carries int4, dequantized only where
computed (`engine.formats.int4`). Gate and up become `gate_up_proj` side by side on the output dim
(the packed tensors' last dim; compressed-tensors': the first), as transformers' fused field stacks
them. compressed-tensors' scales keep the checkpoint's dtype. `INT4` is the format: it detects
`quant_method: gptq | awq` and compressed-tensors' `pack-quantized`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.errors import CorruptCheckpointError, MissingTensorsError
from engine.formats.base import ModelExperts
from engine.formats.compressed_tensors import compressed_weights, int4_checkpoint, is_float
from engine.formats.fields import Int4Words
from engine.formats.int4 import Int4Weight, groups, output_dim, packed_shapes
from engine.formats.int4_checkpoint import Int4Checkpoint, int4_format
from engine.formats.layout import ExpertField, ExpertLayout
from engine.formats.packed_checkpoint import WEIGHTS, per_expert_matrices, quantization_config
from engine.model.checkpoint import Checkpoint


def int4_layout(
    fields: Iterable[tuple[str, tuple[int, int], str, int, int]], scales_dtype: torch.dtype = torch.float16
) -> ExpertLayout:
    """Fields `(name, (out, in), format, groups, g_idx rows)` of an int4 checkpoint, kept in its int32
    words: qweight, qzeros, scales in `scales_dtype` and, for act-order, one g_idx row per matrix."""
    placed = []
    for name, (out, columns), fmt, group_count, g_idx_rows in fields:
        shapes = packed_shapes(fmt, (out, columns), group_count)
        placed.append(ExpertField(name, shapes["qweight"], torch.int32, 0, Int4Words(fmt, (out, columns))))
        placed.append(ExpertField(f"{name}.qzeros", shapes["qzeros"], torch.int32, 0))
        placed.append(ExpertField(f"{name}.scales", shapes["scales"], scales_dtype, 0))
        if g_idx_rows:
            placed.append(ExpertField(f"{name}.g_idx", (g_idx_rows, columns), torch.int32, 0))
    return ExpertLayout.placed(placed)


def _base(weight_name: str) -> str:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


class Int4Experts:
    """An int4 checkpoint's experts, each expert's matrices read apart and packed in their words."""

    def __init__(self, checkpoint: Int4Checkpoint, model: ModelExperts):
        self.checkpoint, self.model = checkpoint, model
        self.disk_layout = disk_layout = per_expert_matrices(model, checkpoint.format.upper(), "int4")
        self.name, shapes = disk_layout.name, model.shapes
        first = disk_layout.names(next(iter(model.prefixes.values())) + ".", 0)
        weights = {field: checkpoint.weight(_base(names[0])) for field, names in first.items()}
        act_order = checkpoint.act_order
        fields = [
            (field, shapes[field], checkpoint.format, groups(weights[field]), len(first[field]) * act_order)
            for field in WEIGHTS
        ]
        self._layout = int4_layout(fields, weights[WEIGHTS[0]].scales.dtype)

    def layer_layout(self, layer: int) -> ExpertLayout:
        return self._layout

    def pack(self, layer: int, expert: int, views) -> None:
        """Write one expert's int4 words, zeros, scales (and g_idx rows) into its packed views."""
        for field, sources in self.disk_layout.names(self.model.prefixes[layer] + ".", expert).items():
            view = views[field]
            parts = [self.checkpoint.weight(_base(name)) for name in sources]
            _check_parts(parts, sources, view)
            dim = output_dim(view.format)  # stacked matrices sit side by side on the output dim
            view.qweight.copy_(torch.cat([part.qweight for part in parts], dim=dim))
            view.qzeros.copy_(torch.cat([part.qzeros for part in parts], dim=dim))
            view.scales.copy_(torch.cat([part.scales for part in parts], dim=dim))
            if view.g_idx is not None:
                rows = [_g_idx(part, name) for part, name in zip(parts, sources, strict=True)]
                view.g_idx.copy_(torch.cat(rows, dim=0))
            else:
                for part, name in zip(parts, sources, strict=True):
                    _check_contiguous_groups(part, name)


def _check_parts(parts: list[Int4Weight], sources, view: Int4Weight) -> None:
    """Each stored matrix is the config's share of the field, in the field's groups."""
    part_shape = (view.shape[0] // len(parts), view.shape[1])
    for name, part in zip(sources, parts, strict=True):
        if part.shape != part_shape or groups(part) != groups(view):
            raise CorruptCheckpointError(
                f"{_base(name)} is a {part.format} weight of shape {part.shape} in "
                f"{groups(part)} groups, but the config implies {part_shape} in "
                f"{groups(view)}. The config and weights disagree."
            )


def _g_idx(part: Int4Weight, name: str) -> torch.Tensor:
    if part.g_idx is None:
        raise MissingTensorsError(
            f"The g_idx of {_base(name)} is missing, but config.json says the checkpoint is act-order "
            "(desc_act: true, actorder: group). The download is incomplete; download the model again."
        )
    return part.g_idx


def _check_contiguous_groups(part: Int4Weight, name: str) -> None:
    """Without act-order, a stored g_idx must be the plain `i // group_size`: the layout drops it."""
    if part.g_idx is None:
        return
    inputs = part.shape[1]
    plain = torch.arange(inputs, dtype=part.g_idx.dtype) // (inputs // groups(part))
    if not torch.equal(part.g_idx[0], plain):
        raise CorruptCheckpointError(
            f"The g_idx of {_base(name)} reorders the groups, but config.json says they are in order "
            "(desc_act: false, no actorder: group). "
            "The config and weights disagree; use the config that came with them."
        )


class Int4Format:
    """Int4 experts in GPTQ, AWQ or compressed-tensors words."""

    name, kept_quantized, repacks_for_cpu = "gptq/awq int4", True, False

    def detect(self, hf_config, checkpoint) -> bool:
        if isinstance(checkpoint, Checkpoint) and int4_format(hf_config) is not None:
            return True
        weights = compressed_weights(hf_config, checkpoint)
        return weights is not None and not is_float(weights)

    def reader(self, hf_config, checkpoint: Checkpoint) -> Int4Checkpoint:
        weights = compressed_weights(hf_config, checkpoint)
        if weights is not None:
            return int4_checkpoint(checkpoint, weights)
        quantization = quantization_config(hf_config)
        act_order, symmetric = bool(quantization.get("desc_act", False)), bool(quantization.get("sym", False))
        return Int4Checkpoint(checkpoint, int4_format(hf_config), act_order, symmetric)

    def kept_as(self, checkpoint: Int4Checkpoint) -> tuple[str, str]:
        return checkpoint.folder.name, f"in {checkpoint.format} int4"

    def open(self, checkpoint: Int4Checkpoint, model: ModelExperts) -> Int4Experts:
        return Int4Experts(checkpoint, model)


INT4 = Int4Format()
