"""Where the shipped resources are: the demo models, and later the catalog and icons.

Looked up in order: `$MOE_CHAT_RESOURCES`; the PyInstaller bundle's folder; the
`resources/` folder beside the packages (a source checkout or editable install).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from engine.errors import ModelNotFoundError

DEMO_FOLDER = "demo-moe"


def resources_dir() -> Path:
    candidates = []
    if env := os.environ.get("MOE_CHAT_RESOURCES"):
        candidates.append(Path(env))
    if bundle := getattr(sys, "_MEIPASS", None):
        candidates.append(Path(bundle) / "resources")
    candidates.append(Path(__file__).resolve().parents[1] / "resources")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    raise ModelNotFoundError(
        "MoE Chat's resources folder is missing (looked in: "
        + ", ".join(str(c) for c in candidates)
        + "). Reinstall the app, or set MOE_CHAT_RESOURCES."
    )


def demo_model_dir() -> Path:
    """The bundled demo MoE (a `qwen3_moe`, 6 layers × 16 experts), used when no model is chosen."""
    return resources_dir() / DEMO_FOLDER / "target"


def demo_draft_dir() -> Path:
    """The demo MoE's dense draft model (same tokenizer and hidden size)."""
    return resources_dir() / DEMO_FOLDER / "draft"
