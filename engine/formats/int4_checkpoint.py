"""GPTQ and AWQ int4 checkpoints as published, read for the resident weights and the experts.

config.json says `quantization_config: {"quant_method": "gptq" | "awq", "bits": 4, "group_size":
128, …}`; each quantized Linear `<name>` is `<name>.qweight`, `<name>.qzeros`, `<name>.scales` (and,
for GPTQ, `<name>.g_idx`) in the layout `engine.formats.int4` describes. Norms, embeddings, routers
and whatever `modules_to_not_convert` names stay as floats.

`Int4Checkpoint` wraps the `Checkpoint`: each quantized Linear reads as `<name>.weight`, dequantized
once at load, and its packed tensors are hidden; `weight` gives a Linear as stored, which the
experts are packed from (`engine.formats.int4_experts`). compressed-tensors' `pack-quantized`
Linears are read by a subclass (`engine.formats.compressed_tensors`).
"""

from __future__ import annotations

import torch

from engine.errors import CorruptCheckpointError, MissingTensorsError, UnsupportedQuantizationError
from engine.formats.int4 import AWQ, GPTQ, GPTQ_V2, PACK, Int4Weight, dequantize, packed_shapes
from engine.formats.packed_checkpoint import PackedCheckpoint, quantization_config
from engine.model.checkpoint import Checkpoint

PACKED = (".qweight", ".qzeros", ".scales", ".g_idx")


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


class Int4Checkpoint(PackedCheckpoint):
    """A `Checkpoint` whose int4 Linears read as `<name>.weight` floats, their packed tensors hidden.

    `PACKED` names a Linear's tensors, its codes first and its scales third (a subclass reads
    another format's names)."""

    PACKED = PACKED

    def __init__(self, checkpoint: Checkpoint, fmt: str, act_order: bool, symmetric: bool = False):
        words = self.PACKED[0]
        quantized = {n[: -len(words)] for n in checkpoint if n.endswith(words)}
        super().__init__(
            checkpoint,
            hidden={base + suffix for base in quantized for suffix in self.PACKED},
            virtual=(base + ".weight" for base in quantized),
            default_dtype=torch.float16,  # the scales' dtype: what GPTQ/AWQ kernels compute in
        )
        self.format, self.act_order, self._quantized = fmt, act_order, quantized
        self.symmetric = symmetric  # the config's `sym`: every zero point is the codes' middle, 8

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
