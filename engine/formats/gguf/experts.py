"""A GGUF file's routed experts, kept in the file's own quantized blocks.

llama.cpp stores a layer's experts as three 3-D tensors, `ffn_gate_exps`, `ffn_up_exps` and
`ffn_down_exps` (`[E, rows, row bytes]` of ggml blocks). One expert's packed buffer holds its
gate and up rows back to back as transformers' `gate_up_proj` (gate first), then its down
rows, each field in its ggml type (`GgmlBlocks`): a Q4_K expert crosses the link as Q4_K bytes
and is dequantized only where it is computed (`engine.formats.gguf.blocks`). Layers may differ
in type (Q4_K_M gives some down projections Q6_K): each layer has its own layout.

`GGUF_BLOCKS` is the format; `repacked_layout` gives a layout's fields another packing, which
`engine.store.placement` chooses when the CPU computes the experts (`engine.formats.gguf.repack`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from gguf import GGMLQuantizationType

from engine.errors import CorruptCheckpointError, MissingTensorsError, UnsupportedQuantizationError
from engine.formats.base import ModelExperts
from engine.formats.fields import GgmlBlocks
from engine.formats.gguf.blocks import row_bytes
from engine.formats.gguf.repack import GGML_PACKINGS, packed_nbytes
from engine.formats.layout import ExpertField, ExpertLayout
from engine.model.gguf_file import GgufCheckpoint

PARTS = ("gate", "up", "down")  # the file's expert tensors: blk.N.ffn_{part}_exps.weight


def ggml_layout(fields: Iterable[tuple[str, tuple[int, int], int, int, str | None]]) -> ExpertLayout:
    """Fields `(name, (out, in), ggml_type, bytes per row, packing)` in ggml blocks, as the file has
    them (packing None) or repacked for the CPU (`engine.formats.gguf.repack`)."""
    return ExpertLayout.placed(_ggml_field(*field) for field in fields)


def _ggml_field(
    name: str, shape: tuple[int, int], ggml_type: int, per_row: int, packing: str | None
) -> ExpertField:
    return ExpertField(name, (shape[0], per_row), torch.uint8, 0, GgmlBlocks(ggml_type, shape, packing))


def repacked_layout(layout: ExpertLayout, packing_of: Callable[[GgmlBlocks], str | None]) -> ExpertLayout:
    """`layout` with each field in ggml blocks in the packing `packing_of` names for it
    (interleaved rows and llama.cpp's own kernels keep the file's bytes); other fields (MXFP4's
    biases) as they are."""
    fields = []
    for f in layout.fields:
        if f.ggml_type is None:
            fields.append(f)
            continue
        packing, (out, columns) = packing_of(f.format), f.format.shape
        if packing not in (None, *GGML_PACKINGS):
            per_row = packed_nbytes(packing, out, columns) // out
        else:
            per_row = row_bytes(f.format.ggml_type, columns)
        fields.append(_ggml_field(f.name, (out, columns), f.format.ggml_type, per_row, packing))
    return ExpertLayout.placed(fields)


class GgufExperts:
    """The experts of a GGUF file, read layer by layer as the model expects them."""

    disk_layout = None  # the file's reader leaves its expert tensors out of the resident ones

    def __init__(self, gguf: GgufCheckpoint, model: ModelExperts):
        self.gguf, self.model = gguf, model
        self._tensors: dict[int, dict] = {}  # layer -> its checked reader tensors, by part

    @property
    def name(self) -> str:
        types = {int(t.tensor_type) for tensors in self._tensors.values() for t in tensors.values()}
        return "gguf " + "/".join(GGMLQuantizationType(t).name for t in sorted(types))

    def layer_layout(self, layer: int) -> ExpertLayout:
        """One expert of a layer: gate and up rows as `gate_up_proj`, then `down_proj`, in the file's
        blocks."""
        self._tensors[layer] = tensors = self._layer_tensors(layer)
        gate, down = tensors["gate"], tensors["down"]
        _, inter, hidden = (int(d) for d in reversed(gate.shape))
        fields = (
            ("gate_up_proj", (2 * inter, hidden), int(gate.tensor_type)),
            ("down_proj", (hidden, inter), int(down.tensor_type)),
        )
        return ggml_layout((name, shape, t, row_bytes(t, shape[1]), None) for name, shape, t in fields)

    def _layer_tensors(self, layer: int) -> dict:
        gguf, num_experts, shapes = self.gguf, self.model.num_experts, self.model.shapes
        tensors = {part: gguf.expert_blocks(layer, part) for part in PARTS}
        missing = [f"blk.{layer}.ffn_{w}_exps.weight" for w, t in tensors.items() if t is None]
        if missing:
            raise MissingTensorsError(
                f"{gguf.parts[0].name} lacks {', '.join(missing)}: the file is incomplete or not a "
                "Mixture-of-Experts model of this architecture."
            )
        inter2, hidden = shapes["gate_up_proj"]
        expected = {"gate": (num_experts, inter2 // 2, hidden), "up": (num_experts, inter2 // 2, hidden)}
        expected["down"] = (num_experts, *shapes["down_proj"])
        for part, tensor in tensors.items():
            found = tuple(int(d) for d in reversed(tensor.shape))
            if found != expected[part]:
                raise CorruptCheckpointError(
                    f"blk.{layer}.ffn_{part}_exps.weight of {gguf.parts[0].name} is {found}, but the "
                    f"metadata implies {expected[part]}: the file's metadata and tensors disagree."
                )
        if tensors["gate"].tensor_type != tensors["up"].tensor_type:
            raise UnsupportedQuantizationError(
                f"Layer {layer} stores its experts' gate as {tensors['gate'].tensor_type.name} and their up "
                f"projection as {tensors['up'].tensor_type.name}; MoE Chat needs them in one type."
            )
        return tensors

    def pack(self, layer: int, expert: int, views) -> None:
        """Read the expert's bytes from the file into its fields: gate rows, up rows, down rows.

        Plain reads, not the memory map: a mapped file's touched pages count as this process's
        memory until it is unmapped, which would double the peak while the store is packed."""
        gate_up, down = views["gate_up_proj"].data, views["down_proj"].data
        half = gate_up.shape[0] // 2
        for target, part in ((gate_up[:half], "gate"), (gate_up[half:], "up"), (down, "down")):
            self._read(self._tensors[layer][part], expert, target.reshape(-1))

    def _read(self, tensor, expert: int, target: torch.Tensor) -> None:
        per_expert = int(tensor.n_bytes) // int(tensor.shape[-1])  # ggml's shape: experts last
        path = self.gguf.file_of[tensor.name]
        with path.open("rb", buffering=0) as file:
            file.seek(int(tensor.data_offset) + expert * per_expert)
            if file.readinto(memoryview(target.numpy())) != per_expert:
                raise CorruptCheckpointError(
                    f"{path.name} ends inside {tensor.name}: the file is truncated. Download it again."
                )


class GgufFormat:
    """A GGUF file's experts in its own ggml blocks."""

    name, kept_quantized, repacks_for_cpu = "gguf", True, True

    def detect(self, hf_config, checkpoint) -> bool:
        return isinstance(checkpoint, GgufCheckpoint)

    def reader(self, hf_config, checkpoint):
        return checkpoint

    def kept_as(self, checkpoint: GgufCheckpoint) -> tuple[str, str]:
        return checkpoint.parts[0].name, "in the file's own types"

    def open(self, checkpoint: GgufCheckpoint, model: ModelExperts) -> GgufExperts:
        return GgufExperts(checkpoint, model)


GGUF_BLOCKS = GgufFormat()
