"""The expert store of a GGUF file: every routed expert kept in the file's own quantized blocks.

llama.cpp stores a layer's experts as three 3-D tensors, `ffn_gate_exps`, `ffn_up_exps` and
`ffn_down_exps` (`[E, rows, row bytes]` of ggml blocks). One expert's packed buffer holds its
gate and up rows back to back as transformers' `gate_up_proj` (gate first), then its down
rows, each field in its ggml type (`ExpertLayout.from_ggml`): a Q4_K expert crosses the link
as Q4_K bytes and is dequantized only where it is computed (`engine.offload.ggml_quants`).
Layers may differ in type (Q4_K_M gives some down projections Q6_K): each layer has its own
layout, and a device slot is as wide as the widest.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.errors import CorruptCheckpointError, MissingTensorsError, UnsupportedQuantizationError
from engine.model.gguf_file import GgufCheckpoint
from engine.offload.expert_store import ExpertLayout, ExpertStore, allocate_layer
from engine.offload.ggml_quants import row_bytes


def build_gguf_store(
    gguf: GgufCheckpoint,
    moe_layers: list[int],
    num_experts: int,
    shapes: dict[str, tuple[int, ...]],
    pin: bool,
    progress: Callable[[int, int], None] | None = None,
) -> ExpertStore:
    """Pack every routed expert of `moe_layers` from the file's blocks, without dequantizing.

    `shapes` are transformers' per-expert field shapes (`gate_up_proj` [2I, H], `down_proj` [H, I])."""
    layouts, layers = {}, {}
    total, done = len(moe_layers) * num_experts, 0
    for layer in moe_layers:
        tensors = _layer_tensors(gguf, layer, num_experts, shapes)
        layout = layer_layout(tensors)
        packed = allocate_layer(num_experts, layout.nbytes, pin, layer)
        _pack_layer(gguf, packed.numpy(), layout, tensors)
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


def layer_layout(tensors: dict) -> ExpertLayout:
    """One expert of a layer: gate and up rows as `gate_up_proj`, then `down_proj`, in ggml blocks."""
    gate, down = tensors["gate"], tensors["down"]
    _, inter, hidden = (int(d) for d in reversed(gate.shape))
    gate_type, down_type = int(gate.tensor_type), int(down.tensor_type)
    return ExpertLayout.from_ggml(
        [
            ("gate_up_proj", (2 * inter, hidden), gate_type, row_bytes(gate_type, hidden)),
            ("down_proj", (hidden, inter), down_type, row_bytes(down_type, inter)),
        ]
    )


def _pack_layer(gguf: GgufCheckpoint, packed: np.ndarray, layout: ExpertLayout, tensors: dict) -> None:
    """Read each expert's bytes from the file into its row of `packed` ([E, nbytes] uint8).

    Plain reads, not the memory map: a mapped file's touched pages count as this process's
    memory until it is unmapped, which would double the peak while the store is packed."""
    fields = {f.name: f for f in layout.fields}
    gate_up, down = fields["gate_up_proj"], fields["down_proj"]
    half = gate_up.nbytes // 2
    for offset, which in ((gate_up.offset, "gate"), (gate_up.offset + half, "up"), (down.offset, "down")):
        tensor = tensors[which]
        per_expert = int(tensor.n_bytes) // packed.shape[0]
        path = gguf.file_of[tensor.name]
        with path.open("rb", buffering=0) as file:
            file.seek(int(tensor.data_offset))
            for expert in range(packed.shape[0]):
                if file.readinto(memoryview(packed[expert, offset : offset + per_expert])) != per_expert:
                    raise CorruptCheckpointError(
                        f"{path.name} ends inside {tensor.name}: the file is truncated. Download it again."
                    )
