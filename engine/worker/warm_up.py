"""What a standby worker does before it is needed: the imports a load of the model would do.

Importing torch, transformers and the engine takes most of a worker's start; a standby worker
pays it ahead of a crash or a restart. It loads no weights, runs torch's CPU kernels once on toy
tensors and never touches the GPU (a CUDA context costs device memory the expert cache wants), so
an idle standby costs host memory only.
"""

from __future__ import annotations

import importlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def warm_up(model_dir: str | None) -> None:
    """Import the worker loop and what loading `model_dir` (None: the demo model) imports."""
    import transformers.modeling_utils  # noqa: F401  the model classes' base, pulled in lazily

    import engine.worker.loop  # noqa: F401  torch, transformers, the engine
    from engine.resources import demo_model_dir

    _first_kernels()
    folder = Path(model_dir) if model_dir else demo_model_dir()
    model_type = _model_type(folder)
    if model_type:
        try:
            importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
        except ImportError:  # a family transformers names otherwise: the load imports it later
            log.debug("No transformers module for model type %s", model_type)


def _model_type(folder: Path) -> str | None:
    try:
        return json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):  # a GGUF file, a folder without a config
        return None


def _first_kernels() -> None:
    """Run torch's CPU matmul and attention once in each dtype: their first call sets up
    kernels (a few hundred ms), which the first reply after a crash would otherwise pay."""
    import torch

    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 8):
            x = torch.randn(tokens, 64, dtype=dtype)
            torch.nn.functional.linear(x, torch.randn(128, 64, dtype=dtype))
            q = x.view(1, 4, tokens, 16)
            torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
