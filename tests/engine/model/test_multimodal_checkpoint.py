"""A vision-language MoE checkpoint loads its language model only (issue 20 item 2)."""

from __future__ import annotations

import torch
from transformers import AutoModelForImageTextToText

from engine.config import ExpertBudget, OffloadConfig
from engine.loader import load_model
from engine.model.checkpoint import Checkpoint
from engine.tiny.models import save_tiny_model
from engine.tiny.registry import shrunk_config


def test_the_vision_tower_is_never_read(tmp_path, monkeypatch):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        published = AutoModelForImageTextToText.from_config(shrunk_config("qwen3_5_moe"), dtype=torch.float32)
    folder = save_tiny_model(published, tmp_path)  # Qwen3_5MoeForConditionalGeneration, as released
    read: list[str] = []
    original = Checkpoint._read

    def recorded(self, name, take, dtype):
        read.append(self._stored_as.get(name, name))  # the name in the file
        return original(self, name, take, dtype)

    monkeypatch.setattr(Checkpoint, "_read", recorded)
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("4"))
    model = load_model(folder, config)
    try:
        assert type(model.hf_model).__name__ == "Qwen3_5MoeForCausalLM"
        assert read and all(name.startswith(("model.language_model.", "lm_head.")) for name in read)
        assert any(".mlp.experts." in name for name in read)  # the routed experts, by their published names
    finally:
        model.close()
