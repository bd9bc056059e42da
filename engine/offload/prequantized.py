"""What every pre-quantized checkpoint's store builder shares (GGUF, MXFP4, FP8, GPTQ/AWQ).

Their experts are kept in the checkpoint's own bytes, so asking for another host precision
(`--expert-dtype int8/int4`) is refused in one sentence; and each builder starts from the
first MoE block's experts module: its per-expert field shapes and expert count.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from engine.errors import InvalidConfigError
from engine.offload.moe_layer import expert_field_shapes


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
