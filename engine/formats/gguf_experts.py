"""The expert store of a GGUF file: every routed expert kept in the file's own quantized blocks.

llama.cpp stores a layer's experts as three 3-D tensors, `ffn_gate_exps`, `ffn_up_exps` and
`ffn_down_exps` (`[E, rows, row bytes]` of ggml blocks). One expert's packed buffer holds its
gate and up rows back to back as transformers' `gate_up_proj` (gate first), then its down
rows, each field in its ggml type (`ExpertLayout.from_ggml`): a Q4_K expert crosses the link
as Q4_K bytes and is dequantized only where it is computed (`engine.formats.gguf_blocks`).
Layers may differ in type (Q4_K_M gives some down projections Q6_K): each layer has its own
layout, and a device slot is as wide as the widest.

With `repack_for` (the compute dtype, when the experts are computed on the CPU), fields are
repacked as they are read where `engine.formats.gguf_repack` has a faster form: Q4_K for torch's
int4 kernel in bfloat16 runs (1.11× the bytes), Q6_K as int8 codes in any (bit-exact, 1.30×);
other types stay as the file has them. With llama.cpp's kernels on experts used where the store
holds them (`interleave`), a layer lives in ggml's own memory and the types llama.cpp interleaves
on this CPU are stored so (`engine.ggml.interleave`, the same bytes in another order).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from engine.errors import (
    CorruptCheckpointError,
    InvalidConfigError,
    MissingTensorsError,
    UnsupportedQuantizationError,
)
from engine.formats.gguf_blocks import row_bytes
from engine.formats.gguf_repack import GGML_PACKINGS, GGML_X8, packed_nbytes, packing_for, repack
from engine.ggml import interleave as ggml_interleave
from engine.ggml import library as ggml_library
from engine.model.gguf_file import GgufCheckpoint
from engine.store.host_store import ExpertLayout, ExpertStore, allocate_layer


def build_gguf_store(
    gguf: GgufCheckpoint,
    moe_layers: list[int],
    num_experts: int,
    shapes: dict[str, tuple[int, ...]],
    pin: bool,
    progress: Callable[[int, int], None] | None = None,
    repack_for: torch.dtype | None = None,
    kernels: str = "exact",
    interleave: bool = False,
) -> ExpertStore:
    """Pack every routed expert of `moe_layers` from the file's blocks, without dequantizing
    (repacked for the CPU computing in `repack_for`, if given).

    `shapes` are transformers' per-expert field shapes (`gate_up_proj` [2I, H], `down_proj` [H, I]).
    With `kernels="ggml"` the CPU computes the file's blocks by llama.cpp's kernels (ggml_kernels),
    on rows interleaved as llama.cpp has them where `interleave` (the experts are used in place)."""
    if kernels == "ggml" and repack_for is not None:
        ready, reason = ggml_library.available()
        if not ready:
            raise InvalidConfigError(f"--kernels ggml cannot run: {reason}. Use --kernels exact.")
    layouts, layers = {}, {}
    total, done = len(moe_layers) * num_experts, 0
    for layer in moe_layers:
        tensors = _layer_tensors(gguf, layer, num_experts, shapes)
        layout = layer_layout(tensors, repack_for, kernels, interleave)
        if any(f.packing == GGML_X8 for f in layout.fields):
            packed = ggml_interleave.allocate(num_experts * layout.nbytes, f"layer {layer}'s experts")
            packed = packed.view(num_experts, layout.nbytes)
        else:
            packed = allocate_layer(num_experts, layout.nbytes, pin, layer)
        if any(f.packing not in (None, *GGML_PACKINGS) for f in layout.fields):
            _repack_layer(gguf, packed, layout, tensors)
        else:  # the file's bytes as they are; interleaved rows are the same bytes, reordered after
            _pack_layer(gguf, packed.numpy(), layout, tensors)
            _interleave_layer(packed, layout)
        layouts[layer], layers[layer] = layout, packed
        done += num_experts
        if progress is not None:
            progress(done, total)
    widest = max(layouts.values(), key=lambda lay: lay.nbytes)
    return ExpertStore(widest, layers, num_experts, layouts)


def _layer_tensors(gguf: GgufCheckpoint, layer: int, num_experts: int, shapes) -> dict:
    tensors = {which: gguf.expert_blocks(layer, which) for which in ("gate", "up", "down")}
    missing = [f"blk.{layer}.ffn_{w}_exps.weight" for w, t in tensors.items() if t is None]
    if missing:
        raise MissingTensorsError(
            f"{gguf.parts[0].name} lacks {', '.join(missing)}: the file is incomplete or not a "
            "Mixture-of-Experts model of this architecture."
        )
    inter2, hidden = shapes["gate_up_proj"]
    expected = {"gate": (num_experts, inter2 // 2, hidden), "up": (num_experts, inter2 // 2, hidden)}
    expected["down"] = (num_experts, *shapes["down_proj"])
    for which, tensor in tensors.items():
        found = tuple(int(d) for d in reversed(tensor.shape))
        if found != expected[which]:
            raise CorruptCheckpointError(
                f"blk.{layer}.ffn_{which}_exps.weight of {gguf.parts[0].name} is {found}, but the "
                f"metadata implies {expected[which]}: the file's metadata and tensors disagree."
            )
    if tensors["gate"].tensor_type != tensors["up"].tensor_type:
        raise UnsupportedQuantizationError(
            f"Layer {layer} stores its experts' gate as {tensors['gate'].tensor_type.name} and their up "
            f"projection as {tensors['up'].tensor_type.name}; MoE Chat needs them in one type."
        )
    return tensors


def layer_layout(
    tensors: dict, repack_for: torch.dtype | None = None, kernels: str = "exact", interleave: bool = False
) -> ExpertLayout:
    """One expert of a layer: gate and up rows as `gate_up_proj`, then `down_proj`, in ggml blocks
    (repacked for the CPU computing in `repack_for` with `kernels`, where `ggml_repack` has a form)."""
    gate, down = tensors["gate"], tensors["down"]
    _, inter, hidden = (int(d) for d in reversed(gate.shape))
    fields = []
    for name, (out, columns), ggml_type in (
        ("gate_up_proj", (2 * inter, hidden), int(gate.tensor_type)),
        ("down_proj", (hidden, inter), int(down.tensor_type)),
    ):
        packing = (
            packing_for(ggml_type, out, columns, repack_for, kernels, interleave)
            if repack_for is not None
            else None
        )
        if packing not in (None, *GGML_PACKINGS):  # the file's blocks (interleaved: the same bytes)
            per_row = packed_nbytes(packing, out, columns) // out
        else:
            per_row = row_bytes(ggml_type, columns)
        fields.append((name, (out, columns), ggml_type, per_row, packing))
    return ExpertLayout.from_ggml(fields)


def layout_of_file(layout: ExpertLayout) -> ExpertLayout:
    """`layout` with every field as the file stores it (no repacking)."""
    return ExpertLayout.from_ggml(
        (f.name, f.weight_shape, f.ggml_type, row_bytes(f.ggml_type, f.weight_shape[1]), None)
        for f in layout.fields
    )


def _repack_layer(gguf: GgufCheckpoint, packed: torch.Tensor, layout: ExpertLayout, tensors: dict) -> None:
    """Each expert read in the file's layout into a one-expert buffer, then repacked into its row."""
    file_layout = layout_of_file(layout)
    staging = torch.empty((1, file_layout.nbytes), dtype=torch.uint8)
    for expert in range(packed.shape[0]):
        _pack_layer(gguf, staging.numpy(), file_layout, tensors, first=expert)
        source, target = file_layout.views(staging[0]), layout.views(packed[expert])
        for field in layout.fields:
            blocks, row = source[field.name].data, target[field.name].data
            if field.packing is not None:
                row.copy_(repack(field.packing, blocks, *field.weight_shape).view(row.shape))
            else:
                row.copy_(blocks)


def _interleave_layer(packed: torch.Tensor, layout: ExpertLayout) -> None:
    """Each expert's fields of packing GGML_X8, read in the file's rows, interleaved where they lie
    by way of a one-field copy (ggml's repack writes one weight while it reads another)."""
    for field in layout.fields:
        if field.packing != GGML_X8:
            continue
        scratch = torch.empty(field.shape, dtype=torch.uint8)
        for expert in range(packed.shape[0]):
            row = layout.views(packed[expert])[field.name].data
            scratch.copy_(row)
            ggml_interleave.interleave_into(row, scratch, field.ggml_type, *field.weight_shape)


def _pack_layer(
    gguf: GgufCheckpoint, packed: np.ndarray, layout: ExpertLayout, tensors: dict, first: int = 0
) -> None:
    """Read each expert's bytes from the file into its row of `packed` ([E, nbytes] uint8), from
    expert `first` on.

    Plain reads, not the memory map: a mapped file's touched pages count as this process's
    memory until it is unmapped, which would double the peak while the store is packed."""
    fields = {f.name: f for f in layout.fields}
    gate_up, down = fields["gate_up_proj"], fields["down_proj"]
    half = gate_up.nbytes // 2
    for offset, which in ((gate_up.offset, "gate"), (gate_up.offset + half, "up"), (down.offset, "down")):
        tensor = tensors[which]
        per_expert = int(tensor.n_bytes) // int(tensor.shape[-1])  # ggml's shape: experts last
        path = gguf.file_of[tensor.name]
        with path.open("rb", buffering=0) as file:
            file.seek(int(tensor.data_offset) + first * per_expert)
            for expert in range(packed.shape[0]):
                if file.readinto(memoryview(packed[expert, offset : offset + per_expert])) != per_expert:
                    raise CorruptCheckpointError(
                        f"{path.name} ends inside {tensor.name}: the file is truncated. Download it again."
                    )
