"""compressed-tensors checkpoints as llm-compressor writes them (RedHatAI / Neural Magic releases).

config.json says `quantization_config: {"quant_method": "compressed-tensors", "format": …,
"config_groups": {"group_0": {"targets": ["Linear"], "weights": {…}, "input_activations": …}},
"ignore": ["lm_head", "re:.*mlp.gate$", …]}`; what is ignored stays in the model's dtype.
`engine.model.check.compressed_tensors_weights` says which schemes load; this module reads them:

- `float-quantized` FP8 (e.g. `*-FP8-dynamic`): `<name>.weight` F8_E4M3 `(out, in)` and
  `<name>.weight_scale` (the model's dtype) of one element (strategy tensor), `[out, 1]` (channel)
  or `[ceil(out/b), ceil(in/b)]` (block, `block_structure`); `W = float(weight) * scale`. Read by
  `Fp8Checkpoint` (`fp8_scales` gives its block): the experts stay FP8
  (`engine.formats.fp8_experts`). Activation scales (dynamic, or a static `input_scale`) are not
  used: the engine computes on the dequantized weights.
- `pack-quantized` int4 (e.g. `*-quantized.w4a16`): `<name>.weight_packed` int32 `[out, in/8]`,
  `<name>.weight_scale` `[out, groups]` (strategy group, or channel: one group), `<name>.weight_shape`
  (`[out, in]`), for asymmetric schemes `<name>.weight_zero_point` int32 `[out/8, groups]`, and with
  `actorder: group` `<name>.weight_g_idx` int32 `[in]`, packed as `engine.formats.int4` describes
  (its formats `CT` and `CT_SYM`). Read by `CompressedInt4Checkpoint`: the experts stay int4
  (`engine.formats.int4_experts`).
"""

from __future__ import annotations

import torch

from engine.errors import CorruptCheckpointError, MissingTensorsError
from engine.formats.int4 import CT, CT_SYM, PACK, Int4Weight, packed_shapes
from engine.formats.int4_checkpoint import Int4Checkpoint
from engine.formats.packed_checkpoint import quantization_config
from engine.model.check import COMPRESSED_TENSORS, compressed_tensors_weights
from engine.model.checkpoint import Checkpoint

INT4_TENSORS = (".weight_packed", ".weight_zero_point", ".weight_scale", ".weight_g_idx", ".weight_shape")


def compressed_weights(hf_config, checkpoint) -> dict | None:
    """The weight scheme of a compressed-tensors checkpoint (one MoE Chat cannot read is refused in
    one sentence); None for any other checkpoint."""
    quant = quantization_config(hf_config) if isinstance(checkpoint, Checkpoint) else {}
    if str(quant.get("quant_method", "")).lower() != COMPRESSED_TENSORS:
        return None
    return compressed_tensors_weights(quant)


def is_float(weights: dict | None) -> bool:
    """Whether a compressed-tensors scheme is FP8 (`float-quantized`) rather than int4."""
    return weights is not None and weights["type"] == "float"


def fp8_scales(weights: dict) -> tuple[tuple[int, int] | None, bool]:
    """The scale block of an FP8 scheme (None: per tensor or per row) and whether it is per row."""
    block = weights.get("block_structure") if weights["strategy"] == "block" else None
    return (tuple(block) if block else None), weights["strategy"] == "channel"


def int4_checkpoint(checkpoint: Checkpoint, weights: dict) -> CompressedInt4Checkpoint:
    """`checkpoint` read through its `pack-quantized` scheme `weights`."""
    fmt = CT_SYM if weights.get("symmetric", True) else CT
    act_order = str(weights.get("actorder")).lower() in ("group", "dynamic")
    return CompressedInt4Checkpoint(checkpoint, fmt, act_order)


class CompressedInt4Checkpoint(Int4Checkpoint):
    """An `Int4Checkpoint` of compressed-tensors' `pack-quantized` tensors."""

    PACKED = INT4_TENSORS  # codes first, scales third, as `Int4Checkpoint` reads them

    def __init__(self, checkpoint: Checkpoint, fmt: str, act_order: bool):
        super().__init__(checkpoint, fmt, act_order)
        self._default_dtype = torch.bfloat16  # the scales' dtype in the published releases

    def weight(self, base: str) -> Int4Weight:
        """The int4 Linear `base` as stored, `(out, 8 × words)`, its tensors' shapes checked. (Its I64
        `weight_shape` is not read: the store and the loader check the shape against the config.)"""
        names = [s for s in INT4_TENSORS[:-1] if base + s in self.packed]
        found = {s: self.packed.read(base + s, None) for s in names}
        words, scales = found.get(".weight_packed"), found.get(".weight_scale")
        if scales is None or (self.format == CT and ".weight_zero_point" not in found):
            raise MissingTensorsError(
                f"The pack-quantized weight {base} lacks its weight_scale or weight_zero_point in "
                f"{self.folder}. The download is incomplete; download the model again."
            )
        shape = (words.shape[0], words.shape[1] * PACK)
        expected = packed_shapes(self.format, shape, scales.shape[-1] if scales.dim() == 2 else 0)
        zeros = found.get(".weight_zero_point", torch.empty(0, expected["qzeros"][1], dtype=torch.int32))
        g_idx = found.get(".weight_g_idx")
        shapes = {"qweight": tuple(words.shape), "qzeros": tuple(zeros.shape), "scales": tuple(scales.shape)}
        g_idx_ok = g_idx is None or tuple(g_idx.shape) == (shape[1],)
        if (
            shapes != expected
            or not expected["scales"][1]
            or shape[1] % expected["scales"][1]
            or not g_idx_ok
        ):
            raise CorruptCheckpointError(
                f"The pack-quantized tensors of {base} have shapes {shapes} (g_idx "
                f"{None if g_idx is None else tuple(g_idx.shape)}), not those of a {shape} weight: "
                f"{expected}. The config and weights disagree."
            )
        rows = None if g_idx is None else g_idx.to(torch.int32)[None]  # [1, in]: one matrix
        return Int4Weight(words, zeros, scales, rows, self.format, shape)
