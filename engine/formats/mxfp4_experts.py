"""The expert store of an MXFP4 checkpoint (gpt-oss as OpenAI ships it): experts kept in MXFP4.

OpenAI's safetensors hold each fused expert matrix `W [out, in]` as two uint8 tensors,
`<name>_blocks [E, out, in/32, 16]` and `<name>_scales [E, out, in/32]` (config.json:
`quantization_config.quant_method == "mxfp4"`). A block is 32 weights: one E8M0 scale
2^(s - 127) and 16 bytes of E2M1 codes, byte j holding weight 2j in its low nibble and
2j + 1 in its high one (transformers' `convert_moe_packed_tensors`).

ggml's MXFP4 block is the same numbers in another order: the scale byte (the same E8M0),
then 16 bytes where byte j holds weight j in its low nibble and weight j + 16 in its high
one. Each expert is repacked into that order as it is read, a byte rearrangement with no
rounding, so `gate_up_proj` and `down_proj` become ggml MXFP4 fields of `(out, in)` =
`(2I, H)` and `(H, I)` (`ExpertLayout` ggml fields are always `(out, in)` rows, whatever the
family's own orientation: gpt-oss holds its weights transposed, `[in, out]`). The biases
stay native fields in the compute dtype. From there the store is like a GGUF file's: the
link carries MXFP4 bytes and `engine.formats.gguf_blocks` dequantizes them where computed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from gguf import GGMLQuantizationType

from engine.errors import CorruptCheckpointError, UnsupportedQuantizationError
from engine.formats.gguf_blocks import row_bytes
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.checkpoint import Checkpoint
from engine.store.host_store import ExpertField, ExpertLayout, ExpertStore, allocate_layer
from engine.store.prequantized import first_experts, refuse_requantization

MXFP4 = GGMLQuantizationType.MXFP4
BLOCK = 32  # weights per MXFP4 block
WEIGHTS = ("gate_up_proj", "down_proj")
Progress = Callable[[str, int, int], None]  # (stage, done, total), as the loader reports


def is_mxfp4(hf_config) -> bool:
    """Whether the config says the checkpoint's experts are MXFP4 blocks (gpt-oss's release)."""
    quant = getattr(hf_config, "quantization_config", None)
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    return str(method).lower() == "mxfp4"


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
        ExpertField(name, (out, row_bytes(MXFP4, columns)), torch.uint8, 0, int(MXFP4), (out, columns))
        for name, (out, columns) in weights.items()
    ]
    fields += [ExpertField(name, tuple(shape), dtype, 0) for name, shape in biases.items()]
    return ExpertLayout._placed(fields)


def build_mxfp4_store(
    checkpoint: Checkpoint,
    arch: Architecture,
    blocks: Mapping[int, tuple[str, torch.nn.Module]],
    dtype: torch.dtype,
    pin: bool,
    expert_dtype: str,
    progress: Progress | None = None,
) -> tuple[ExpertStore, DiskLayout]:
    """Every routed expert of the MoE `blocks` (layer → (prefix, block)), kept in MXFP4."""
    refuse_requantization(checkpoint.folder.name, "in MXFP4", expert_dtype)
    disk_layout = mxfp4_disk_layout(arch)
    experts, shapes, num_experts = first_experts(blocks)
    transposed = getattr(experts, "is_transposed", False)  # gpt-oss: [in, out]
    weights = {w: shapes[w][::-1] if transposed else shapes[w] for w in WEIGHTS}
    biases = {name: shape for name, shape in shapes.items() if name not in WEIGHTS}
    layout = mxfp4_layout(weights, biases, dtype)
    layers, total = {}, len(blocks) * num_experts
    for done, (layer, (prefix, _)) in enumerate(sorted(blocks.items())):
        names = disk_layout.names(prefix + ".", 0)
        _check_shapes(checkpoint, names, weights, biases, num_experts)
        layers[layer] = allocate_layer(num_experts, layout.nbytes, pin, layer)
        for expert in range(num_experts):
            _pack_expert(checkpoint, names, expert, layout.views(layers[layer][expert]), dtype)
        if progress is not None:
            progress("experts", (done + 1) * num_experts, total)
    return ExpertStore(layout, layers, num_experts), disk_layout


def _check_shapes(checkpoint: Checkpoint, names, weights, biases, experts: int) -> None:
    """Every tensor of the layer is as the config implies: U8 blocks and scales, float biases."""
    expected = {}
    for weight, (out, columns) in weights.items():
        blocks_name, scales_name = names[weight]
        expected[blocks_name] = ("U8", (experts, out, columns // BLOCK, 16))
        expected[scales_name] = ("U8", (experts, out, columns // BLOCK))
    expected.update({names[bias][0]: (None, (experts, *shape)) for bias, shape in biases.items()})
    for name, (dtype_name, shape) in expected.items():
        found, stored = checkpoint.shape(name), checkpoint.dtype_name(name)
        if found != shape or stored != (dtype_name or stored):
            raise CorruptCheckpointError(
                f"{name} is {stored} {found}, but an MXFP4 checkpoint of this config holds "
                f"{dtype_name or 'a float'} {shape}: the config and weights disagree. Download it again."
            )


def _pack_expert(checkpoint: Checkpoint, names, expert: int, views, dtype: torch.dtype) -> None:
    """Write one expert's repacked MXFP4 weights and its biases into its packed views."""
    for field, sources in names.items():
        if field in WEIGHTS:
            blocks, scales = (checkpoint.read_index(name, expert) for name in sources)
            views[field].data.copy_(repack_to_ggml(blocks, scales))
        else:
            views[field].copy_(checkpoint.read_index(sources[0], expert, dtype))
