"""Registry of architecture adapters, one module per Hugging Face `model_type`.

Each adapter module holds one `Architecture` (engine.model.adapters.base): data on where
a family's MoE blocks are and what its router and experts need, no code paths.
"""

from __future__ import annotations

import importlib

from engine.errors import UnsupportedArchitectureError
from engine.model.adapters.base import Architecture

SUPPORTED_MODEL_TYPES: tuple[str, ...] = (
    "qwen3_moe",
    "qwen2_moe",
    "mixtral",
    "olmoe",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
    "phimoe",
    "granitemoe",
)


def get_architecture(model_type: str | None) -> Architecture:
    """The adapter for `model_type`, or a clear error listing what is supported."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"Architecture {model_type!r} is not supported. MoE Chat runs Mixture-of-Experts models of "
            f"these types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    module = importlib.import_module(f"engine.model.adapters.{model_type}")
    return module.ARCHITECTURE
