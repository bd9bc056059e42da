"""Helpers for the error tests: a CPU config, and ways to break a copy of a model folder."""

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from engine.config import OffloadConfig
from engine.generation import GenerationConfig, generate_text
from engine.loader import load_model
from engine.sampling import SamplingConfig

CPU = OffloadConfig(device="cpu")
GREEDY_4 = GenerationConfig(max_new_tokens=4, sampling=SamplingConfig(greedy=True))
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"  # [H=64, I=32], not in the first MoE layer
EXPERT_NBYTES = (2 * 32 * 64 + 64 * 32) * 4  # one fp32 expert: gate_up [64, 64] + down [64, 32]


def load_ok(folder: Path) -> None:
    """The folder loads and generates: an earlier failure left nothing in the way."""
    model = load_model(folder, CPU)
    try:
        assert len(generate_text(model, [1, 2, 3], GREEDY_4).token_ids) >= 1
    finally:
        model.close()


def edit_config(folder: Path, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def edit_weights(folder: Path, edit) -> None:
    """Rewrite model.safetensors with `edit(tensors)` applied (tensors copied out of the file first)."""
    path = folder / "model.safetensors"
    tensors = {name: t.clone() for name, t in load_file(path).items()}
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def mapped_files(folder: Path) -> list[str]:
    return [line for line in Path("/proc/self/maps").read_text().splitlines() if str(folder) in line]
