"""The experts of an MXFP4 checkpoint (gpt-oss as OpenAI ships it), kept in MXFP4.

OpenAI's safetensors hold each fused expert matrix `W [out, in]` as two uint8 tensors,
`<name>_blocks [E, out, in/32, 16]` and `<name>_scales [E, out, in/32]` (config.json:
`quantization_config.quant_method == "mxfp4"`). A block is 32 weights: one E8M0 scale
2^(s - 127) and 16 bytes of E2M1 codes, byte j holding weight 2j in its low nibble and
2j + 1 in its high one (transformers' `convert_moe_packed_tensors`).

ggml's MXFP4 block is the same numbers in another order: the scale byte (the same E8M0),
then 16 bytes where byte j holds weight j in its low nibble and weight j + 16 in its high
one. Each expert is repacked into that order as it is read, a byte rearrangement with no
rounding, so `gate_up_proj` and `down_proj` become ggml MXFP4 fields of `(out, in)` =
`(2I, H)` and `(H, I)` (ggml fields are always `(out, in)` rows, whatever the family's own
orientation: gpt-oss holds its weights transposed, `[in, out]`). The biases stay plain fields
in the compute dtype. From there the experts are like a GGUF file's: the link carries MXFP4
bytes and `engine.formats.gguf.blocks` dequantizes them where computed. `MXFP4` is the format.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from gguf import GGMLQuantizationType

from engine.errors import CorruptCheckpointError, UnsupportedQuantizationError
from engine.formats.base import ModelExperts
from engine.formats.fields import GgmlBlocks
from engine.formats.gguf.blocks import row_bytes
from engine.formats.layout import ExpertField, ExpertLayout
from engine.formats.packed_checkpoint import WEIGHTS, quantization_config
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.checkpoint import Checkpoint

MXFP4_TYPE = GGMLQuantizationType.MXFP4
BLOCK = 32  # weights per MXFP4 block


def is_mxfp4(hf_config) -> bool:
    """Whether the config says the checkpoint's experts are MXFP4 blocks (gpt-oss's release)."""
    return str(quantization_config(hf_config).get("quant_method")).lower() == "mxfp4"


def mxfp4_disk_layout(arch: Architecture) -> DiskLayout:
    """The family's fused layout with each weight matrix as its `_blocks` and `_scales` tensors."""
    fused = [layout for layout in arch.layouts if not layout.per_expert]
    if not fused:
        raise UnsupportedQuantizationError(
            f"MXFP4 checkpoints of {arch.model_type} are not supported: MoE Chat reads MXFP4 experts "
            "only from fused per-layer tensors, as gpt-oss ships them. Use the model's BF16 release."
        )
    sources = dict(fused[0].sources)
    for weight in WEIGHTS:
        (name,) = sources[weight]
        sources[weight] = (f"{name}_blocks", f"{name}_scales")
    return DiskLayout(name=f"mxfp4 {fused[0].name.removeprefix('fused ')}", sources=sources)


def repack_to_ggml(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OpenAI's `blocks [out, G, 16]` and `scales [out, G]` -> ggml MXFP4 rows `[out, G * 17]`."""
    codes = torch.stack((blocks & 0xF, blocks >> 4), dim=-1).flatten(-2)  # [out, G, 32], weight order
    qs = codes[..., :16] | (codes[..., 16:] << 4)  # byte j: weight j low, weight j + 16 high
    return torch.cat((scales.unsqueeze(-1), qs), dim=-1).flatten(-2)


def mxfp4_layout(
    weights: Mapping[str, tuple[int, int]], biases: Mapping[str, tuple[int, ...]], dtype: torch.dtype
) -> ExpertLayout:
    """One expert: each weight `(out, in)` as ggml MXFP4 rows, then each bias in `dtype`."""
    fields = [
        ExpertField(
            name,
            (out, row_bytes(MXFP4_TYPE, columns)),
            torch.uint8,
            0,
            GgmlBlocks(int(MXFP4_TYPE), (out, columns)),
        )
        for name, (out, columns) in weights.items()
    ]
    fields += [ExpertField(name, tuple(shape), dtype, 0) for name, shape in biases.items()]
    return ExpertLayout.placed(fields)


class Mxfp4Experts:
    """gpt-oss's experts: fused per-layer tensors, each expert's weights repacked into ggml's order."""

    def __init__(self, checkpoint: Checkpoint, model: ModelExperts):
        self.checkpoint, self.model = checkpoint, model
        self.disk_layout = mxfp4_disk_layout(model.arch)
        self.name = self.disk_layout.name
        shapes = model.shapes
        self.weights = {
            w: shapes[w][::-1] if model.transposed else shapes[w] for w in WEIGHTS
        }  # gpt-oss: [in, out]
        self.biases = {name: shape for name, shape in shapes.items() if name not in WEIGHTS}
        self._layout = mxfp4_layout(self.weights, self.biases, model.dtype)

    def _names(self, layer: int) -> dict[str, tuple[str, ...]]:
        return self.disk_layout.names(self.model.prefixes[layer] + ".", 0)

    def layer_layout(self, layer: int) -> ExpertLayout:
        """Every tensor of the layer as the config implies (U8 blocks and scales, float biases)."""
        names, experts = self._names(layer), self.model.num_experts
        expected = {}
        for weight, (out, columns) in self.weights.items():
            blocks_name, scales_name = names[weight]
            expected[blocks_name] = ("U8", (experts, out, columns // BLOCK, 16))
            expected[scales_name] = ("U8", (experts, out, columns // BLOCK))
        expected.update({names[bias][0]: (None, (experts, *shape)) for bias, shape in self.biases.items()})
        for name, (dtype_name, shape) in expected.items():
            found, stored = self.checkpoint.shape(name), self.checkpoint.dtype_name(name)
            if found != shape or stored != (dtype_name or stored):
                raise CorruptCheckpointError(
                    f"{name} is {stored} {found}, but an MXFP4 checkpoint of this config holds "
                    f"{dtype_name or 'a float'} {shape}: the config and weights disagree. Download it again."
                )
        return self._layout

    def pack(self, layer: int, expert: int, views) -> None:
        """Write one expert's repacked MXFP4 weights and its biases into its packed views."""
        for field, sources in self._names(layer).items():
            if field in WEIGHTS:
                blocks, scales = (self.checkpoint.read_index(name, expert) for name in sources)
                views[field].data.copy_(repack_to_ggml(blocks, scales))
            else:
                views[field].copy_(self.checkpoint.read_index(sources[0], expert, self.model.dtype))


class Mxfp4Format:
    """gpt-oss's MXFP4 experts, kept as ggml MXFP4 blocks."""

    name, kept_quantized, repacks_for_cpu = "mxfp4", True, True

    def detect(self, hf_config, checkpoint) -> bool:
        return isinstance(checkpoint, Checkpoint) and is_mxfp4(hf_config)

    def reader(self, hf_config, checkpoint: Checkpoint) -> Checkpoint:
        return checkpoint

    def kept_as(self, checkpoint: Checkpoint) -> tuple[str, str]:
        return checkpoint.folder.name, "in MXFP4"

    def open(self, checkpoint: Checkpoint, model: ModelExperts) -> Mxfp4Experts:
        return Mxfp4Experts(checkpoint, model)


MXFP4 = Mxfp4Format()
