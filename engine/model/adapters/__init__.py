"""The architecture adapter: one generic reader of transformers' MoE modules, and a table of
the families it accepts.

`get_architecture(model_type)` gives an `Architecture` (engine.model.adapters.base) holding the
family's override entry (engine.model.adapters.overrides); the loader completes it from the model
itself (engine.model.adapters.generic.bind); MoE blocks that are not on transformers' experts
interface are rewritten onto it (engine.model.adapters.rewrites). This package imports neither
torch nor transformers (the GUI reads `SUPPORTED_MODEL_TYPES`).

`SUPPORTED_MODEL_TYPES` are the MoE families of transformers' registry the generic adapter
accepts: every one not listed in `NOT_SUPPORTED` with its reason. tests/engine/model/
test_all_families.py builds the list again from the registry, checks it equals this one, and
checks each family exact against transformers.
"""

from __future__ import annotations

from engine.errors import UnsupportedArchitectureError
from engine.model.adapters.base import Architecture
from engine.model.adapters.families import NOT_SUPPORTED, SUPPORTED_MODEL_TYPES
from engine.model.adapters.overrides import OVERRIDES

__all__ = ["NOT_SUPPORTED", "SUPPORTED_MODEL_TYPES", "Architecture", "get_architecture"]


def get_architecture(model_type: str | None) -> Architecture:
    """The adapter for `model_type`, or a clear error listing what is supported."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        reason = f" ({NOT_SUPPORTED[model_type]})" if model_type in NOT_SUPPORTED else ""
        raise UnsupportedArchitectureError(
            f"Architecture {model_type!r} is not supported{reason}. MoE Chat runs Mixture-of-Experts "
            f"models of these types: {', '.join(SUPPORTED_MODEL_TYPES)}."
        )
    return Architecture(model_type=model_type, **OVERRIDES.get(model_type, {}))
