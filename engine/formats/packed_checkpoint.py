"""What every pre-quantized checkpoint's store builder shares (GGUF, MXFP4, FP8, GPTQ/AWQ).

Their experts are kept in the checkpoint's own bytes, so asking for another host precision
(`--expert-dtype int8/int4`) is refused in one sentence; each builder starts from the first
MoE block's experts module (its per-expert field shapes and expert count) and, for formats
that store each expert's matrices apart, from the family's per-expert disk layout.
`PackedCheckpoint` is the view the loader reads resident weights through: a `Checkpoint`
whose format's extra tensors (scales, zeros) are hidden and whose quantized weights read as
floats (the subclass says how).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping

import torch

from engine.errors import InvalidConfigError, UnsupportedQuantizationError
from engine.model.adapters.base import Architecture, DiskLayout
from engine.model.checkpoint import SUPPORTED_DTYPES, Checkpoint


def refuse_requantization(source: str, kept_as: str, expert_dtype: str) -> None:
    """`source`'s experts are kept `kept_as`; any `expert_dtype` but native is an error."""
    if expert_dtype != "native":
        raise InvalidConfigError(
            f"{source} is quantized already: its experts are kept {kept_as}. "
            f"Load it with --expert-dtype native, not {expert_dtype}."
        )


def first_experts(
    blocks: Mapping[int, tuple[str, torch.nn.Module]],
) -> tuple[torch.nn.Module, dict[str, tuple[int, ...]], int]:
    """The first MoE block's experts module, its per-expert field shapes and its expert count."""
    experts = next(iter(blocks.values()))[1].experts
    return experts, expert_field_shapes(experts), experts.num_experts


def per_expert_disk_layout(arch: Architecture, format_name: str) -> DiskLayout:
    """The family's per-expert layout: FP8 and GPTQ/AWQ checkpoints hold each expert's matrices apart."""
    per_expert = [layout for layout in arch.layouts if layout.per_expert]
    if not per_expert:
        raise UnsupportedQuantizationError(
            f"{format_name} checkpoints of {arch.model_type} are not supported: MoE Chat reads "
            f"{format_name} experts only as per-expert matrices. Use the model's BF16 release."
        )
    return per_expert[0]


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


def expert_field_shapes(original: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Per-expert field shapes of a transformers fused experts module (its params are `[E, …]`)."""
    return {name: tuple(param.shape[1:]) for name, param in original.named_parameters(recurse=False)}
