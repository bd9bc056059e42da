"""What the readers of pre-quantized safetensors checkpoints (FP8, GPTQ/AWQ, compressed-tensors) share.

`PackedCheckpoint` is the view the loader reads resident weights through: a `Checkpoint` whose
format's extra tensors (scales, zeros) are hidden and whose quantized weights read as floats (the
subclass says how). `quantization_config` is the config's `quantization_config` as a dict;
`per_expert_disk_layout` the family's layout of per-expert matrices, the one FP8 and int4
checkpoints store their experts in (`per_expert_matrices`: checked against the model).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator

import torch

from engine.errors import UnsupportedQuantizationError
from engine.formats.base import ModelExperts
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.checkpoint import SUPPORTED_DTYPES, Checkpoint

WEIGHTS = ("gate_up_proj", "down_proj")  # transformers' fused expert weights


def per_expert_disk_layout(arch: Architecture, format_name: str) -> DiskLayout:
    """The family's per-expert layout: FP8 and GPTQ/AWQ checkpoints hold each expert's matrices apart."""
    per_expert = [layout for layout in arch.layouts if layout.per_expert]
    if not per_expert:
        raise UnsupportedQuantizationError(
            f"{format_name} checkpoints of {arch.model_type} are not supported: MoE Chat reads "
            f"{format_name} experts only as per-expert matrices. Use the model's BF16 release."
        )
    return per_expert[0]


def per_expert_matrices(model: ModelExperts, format_name: str, kept: str) -> DiskLayout:
    """The family's per-expert layout, for experts of gate/up/down matrices without biases held
    `(out, in)`: what MoE Chat keeps FP8 and int4 experts as (`kept`)."""
    disk_layout = per_expert_disk_layout(model.arch, format_name)
    if set(model.shapes) != set(WEIGHTS) or model.transposed:
        raise UnsupportedQuantizationError(
            f"{format_name} experts of {model.arch.model_type} ({', '.join(model.shapes)}) are not "
            f"supported: MoE Chat keeps {kept} experts of gate/up/down matrices without biases. "
            "Use the model's BF16 release."
        )
    return disk_layout


def quantization_config(hf_config) -> dict:
    """The config's `quantization_config` as a dict ({} without one)."""
    quant = getattr(hf_config, "quantization_config", None)
    if quant is None:
        return {}
    return dict(quant) if isinstance(quant, dict) else quant.to_dict()


class PackedCheckpoint:
    """A `Checkpoint` read by Hugging Face name with the format's `hidden` tensors left out and
    `virtual` names (weights the subclass rebuilds in `read`) added."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        hidden: Collection[str],
        virtual: Iterable[str] = (),
        default_dtype: torch.dtype = torch.bfloat16,
    ):
        self.packed, self.folder = checkpoint, checkpoint.folder
        self._stored = [n for n in checkpoint if n not in hidden]
        self._names = self._stored + sorted(virtual)
        self._visible = set(self._names)
        self._default_dtype = default_dtype

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: str) -> bool:
        return name in self._visible

    def shape(self, name: str) -> tuple[int, ...]:
        return self.packed.shape(name)

    def dtype_name(self, name: str) -> str:
        return self.packed.dtype_name(name)

    def quantized_tensor(self, name: str, also: frozenset = frozenset()):
        """A stored float matrix as ggml rows (`Checkpoint.quantized_tensor`); None for a quantized
        one (its `.weight` is virtual: the file has no such tensor), which reads as floats (`read`)."""
        return self.packed.quantized_tensor(name, also)

    def storage_dtype(self) -> torch.dtype:
        """The dtype most unquantized tensors (norms, embeddings, routers) are stored in; the
        format's compute dtype when every tensor is quantized."""
        counts: dict[str, int] = {}
        for name in self._stored:
            dtype_name = self.packed.dtype_name(name)
            if dtype_name in SUPPORTED_DTYPES:
                counts[dtype_name] = counts.get(dtype_name, 0) + 1
        return SUPPORTED_DTYPES[max(counts, key=counts.get)] if counts else self._default_dtype

    def close(self) -> None:
        self.packed.close()
