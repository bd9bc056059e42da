"""GPTQ and AWQ int4 checkpoints as published: experts kept in int4, the rest dequantized at load.

config.json says `quantization_config: {"quant_method": "gptq" | "awq", "bits": 4, "group_size":
128, …}`; each quantized Linear `<name>` is `<name>.qweight`, `<name>.qzeros`, `<name>.scales` (and,
for GPTQ, `<name>.g_idx`) in the layout `engine.formats.int4` describes. Norms, embeddings, routers
and whatever `modules_to_not_convert` names stay as floats.

Two readers of the same folder, as for FP8 (`engine.store.from_fp8`):
- `Int4Checkpoint` wraps the `Checkpoint` for the resident weights: each quantized Linear reads as
  `<name>.weight`, dequantized once at load, and its packed tensors are hidden.
- `build_int4_store` packs each routed expert's own qweight/qzeros/scales words (`g_idx` rows too
  when the config says act-order) into an int4 layout (`ExpertLayout.from_int4`): the link carries
  int4, dequantized only where computed. Gate and up become `gate_up_proj` side by side on the
  output dim (the packed tensors' last dim), as transformers' fused field stacks them.

compressed-tensors' `pack-quantized` Linears (`engine.store.from_compressed_tensors`) are read by a
subclass and packed here alike, their scales kept in the checkpoint's dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch

from engine.errors import (
    CorruptCheckpointError,
    MissingTensorsError,
    UnsupportedQuantizationError,
)
from engine.formats.int4 import (
    AWQ,
    GPTQ,
    GPTQ_V2,
    PACK,
    Int4Weight,
    dequantize,
    groups,
    output_dim,
    packed_shapes,
)
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.checkpoint import Checkpoint
from engine.store.from_fp8 import WEIGHTS
from engine.store.host_store import ExpertLayout, ExpertStore, allocate_layer
from engine.store.prequantized import (
    PackedCheckpoint,
    first_experts,
    per_expert_disk_layout,
    quantization_config,
    refuse_requantization,
)

PACKED = (".qweight", ".qzeros", ".scales", ".g_idx")
Progress = Callable[[str, int, int], None]  # (stage, done, total), as the loader reports


def int4_format(hf_config) -> str | None:
    """The int4 format of a GPTQ/AWQ config ("gptq", "gptq_v2" or "awq"), None for other configs."""
    quant = quantization_config(hf_config)
    method = str(quant.get("quant_method", "")).lower()
    if method not in (GPTQ, AWQ):
        return None
    problem = None
    if int(quant.get("bits", 4)) != 4:
        problem = f"{quant.get('bits')}-bit weights (MoE Chat reads 4-bit)"
    elif method == AWQ and str(quant.get("version", "gemm")).lower() != "gemm":
        problem = f"AWQ version {quant.get('version')} (MoE Chat reads the GEMM layout)"
    elif method == AWQ and not quant.get("zero_point", True):
        problem = "AWQ without zero points (MoE Chat reads zero_point: true)"
    if problem:
        raise UnsupportedQuantizationError(
            f"This {method.upper()} checkpoint has {problem}. Use a 4-bit GEMM release or the BF16 one."
        )
    if method == AWQ:
        return AWQ
    checkpoint_format = str(quant.get("checkpoint_format") or quant.get("format") or GPTQ).lower()
    return GPTQ_V2 if checkpoint_format == GPTQ_V2 else GPTQ


def int4_checkpoint(hf_config, checkpoint) -> tuple[object, object]:
    """The config and `checkpoint` as the loader reads it: wrapped in an `Int4Checkpoint` when the
    model is GPTQ/AWQ int4."""
    fmt = int4_format(hf_config) if isinstance(checkpoint, Checkpoint) else None
    if fmt is not None:
        checkpoint = Int4Checkpoint(
            checkpoint, fmt, bool(quantization_config(hf_config).get("desc_act", False))
        )
    return hf_config, checkpoint


class Int4Checkpoint(PackedCheckpoint):
    """A `Checkpoint` whose int4 Linears read as `<name>.weight` floats, their packed tensors hidden.

    `PACKED` names a Linear's tensors, its codes first and its scales third (a subclass reads
    another format's names)."""

    PACKED = PACKED

    def __init__(self, checkpoint: Checkpoint, fmt: str, act_order: bool):
        words = self.PACKED[0]
        quantized = {n[: -len(words)] for n in checkpoint if n.endswith(words)}
        super().__init__(
            checkpoint,
            hidden={base + suffix for base in quantized for suffix in self.PACKED},
            virtual=(base + ".weight" for base in quantized),
            default_dtype=torch.float16,  # the scales' dtype: what GPTQ/AWQ kernels compute in
        )
        self.format, self.act_order, self._quantized = fmt, act_order, quantized

    def _base(self, name: str) -> str | None:
        base = name[: -len(".weight")] if name.endswith(".weight") else None
        return base if base in self._quantized else None

    def shape(self, name: str) -> tuple[int, ...]:
        base = self._base(name)
        return self.weight(base).shape if base else self.packed.shape(name)

    def dtype_name(self, name: str) -> str:
        base = self._base(name)
        return self.packed.dtype_name(base + self.PACKED[2] if base else name)

    def read(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`; an int4 Linear's weight dequantized, in `dtype` (float32 if None)."""
        base = self._base(name)
        if base is None:
            return self.packed.read(name, dtype)
        return dequantize(self.weight(base), dtype or torch.float32)

    def weight(self, base: str) -> Int4Weight:
        """The int4 Linear `base` as stored, its shapes checked; `g_idx` as one row, when stored."""
        tensors = {}
        for suffix in PACKED:
            if base + suffix in self.packed:
                tensors[suffix[1:]] = self.packed.read(base + suffix, None)
        if len(tensors) < 3:
            raise MissingTensorsError(
                f"The {self.format} weight {base} lacks its qzeros or scales in {self.folder}. "
                "The download is incomplete; download the model again."
            )
        qweight, scales = tensors["qweight"], tensors["scales"]
        inputs = qweight.shape[0] * (1 if self.format == AWQ else PACK)
        shape = (scales.shape[-1], inputs)
        g_idx = tensors.get("g_idx")
        expected = packed_shapes(self.format, shape, scales.shape[0])
        found = {key: tuple(tensors[key].shape) for key in expected}
        if found != expected or inputs % scales.shape[0] or (g_idx is not None and g_idx.shape != (inputs,)):
            raise CorruptCheckpointError(
                f"The {self.format} tensors of {base} have shapes {found} (g_idx "
                f"{None if g_idx is None else tuple(g_idx.shape)}), not those of a {shape} weight: "
                f"{expected}. The config and weights disagree."
            )
        rows = None if g_idx is None else g_idx[None]  # [1, in]: one matrix
        return Int4Weight(qweight, tensors["qzeros"], scales, rows, self.format, shape)


def build_int4_store(
    checkpoint: Int4Checkpoint,
    arch: Architecture,
    blocks: Mapping[int, tuple[str, torch.nn.Module]],
    pin: bool,
    expert_dtype: str,
    progress: Progress | None = None,
) -> tuple[ExpertStore, DiskLayout]:
    """Every routed expert of the MoE `blocks` (layer → (prefix, block)), kept in int4."""
    refuse_requantization(checkpoint.folder.name, f"in {checkpoint.format} int4", expert_dtype)
    disk_layout = per_expert_disk_layout(arch, checkpoint.format.upper())
    experts, shapes, num_experts = first_experts(blocks)
    if set(shapes) != set(WEIGHTS) or getattr(experts, "is_transposed", False):
        raise UnsupportedQuantizationError(
            f"{checkpoint.format} experts of {arch.model_type} ({', '.join(shapes)}) are not supported: "
            "MoE Chat keeps int4 experts of gate/up/down matrices without biases. Use the BF16 release."
        )
    first_prefix = next(iter(sorted(blocks.items())))[1][0] + "."
    first = disk_layout.names(first_prefix, 0)
    weights = {field: checkpoint.weight(_base(names[0])) for field, names in first.items()}
    fields = [
        (
            field,
            shapes[field],
            checkpoint.format,
            groups(weights[field]),
            len(first[field]) * checkpoint.act_order,
        )
        for field in WEIGHTS
    ]
    layout = _int4_layout(fields, weights[WEIGHTS[0]].scales.dtype)
    layers, total = {}, len(blocks) * num_experts
    for done, (layer, (prefix, _)) in enumerate(sorted(blocks.items())):
        layers[layer] = allocate_layer(num_experts, layout.nbytes, pin, layer)
        for expert in range(num_experts):
            names = disk_layout.names(prefix + ".", expert)
            _pack_expert(checkpoint, names, layout.views(layers[layer][expert]))
        if progress is not None:
            progress("experts", (done + 1) * num_experts, total)
    return ExpertStore(layout, layers, num_experts), disk_layout


def _int4_layout(fields, scales_dtype: torch.dtype) -> ExpertLayout:
    """`ExpertLayout.from_int4` with the scales in the checkpoint's own dtype (compressed-tensors
    stores bf16 ones, which float16 would round)."""
    layout = ExpertLayout.from_int4(fields)
    if scales_dtype == torch.float16:
        return layout
    retyped = ExpertLayout.from_fields(
        (f.name, f.shape, scales_dtype if f.name.endswith(".scales") else f.dtype) for f in layout.fields
    )
    kept = zip(layout.fields, retyped.fields, strict=True)
    fields = tuple(
        dataclasses.replace(new, int4=old.int4, weight_shape=old.weight_shape) for old, new in kept
    )
    return dataclasses.replace(retyped, fields=fields)


def _base(weight_name: str) -> str:
    return weight_name[: -len(".weight")] if weight_name.endswith(".weight") else weight_name


def _pack_expert(checkpoint: Int4Checkpoint, names, views) -> None:
    """Write one expert's int4 words, zeros, scales (and g_idx rows) into its packed views."""
    for field, sources in names.items():
        view = views[field]
        parts = [checkpoint.weight(_base(name)) for name in sources]
        part_shape = (view.shape[0] // len(parts), view.shape[1])
        for name, part in zip(sources, parts, strict=True):
            if part.shape != part_shape or groups(part) != groups(view):
                raise CorruptCheckpointError(
                    f"{_base(name)} is a {part.format} weight of shape {part.shape} in "
                    f"{groups(part)} groups, but the config implies {part_shape} in "
                    f"{groups(view)}. The config and weights disagree."
                )
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
