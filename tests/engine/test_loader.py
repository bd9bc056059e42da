"""What loading builds: experts only in the store, read one at a time; routing kept per layer."""

import dataclasses
import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.loader import load_model
from engine.model.checkpoint import Checkpoint
from engine.moe.layer import OffloadedExperts
from engine.tiny.models import build_tiny_model, make_tiny_model, save_tiny_model

CONFIG = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=4))


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_experts_are_read_one_at_a_time(tmp_path, monkeypatch, layout):
    folder = save_tiny_model(build_tiny_model("qwen3_moe"), tmp_path, layout=layout)
    largest_read = []
    real_read, real_read_index = Checkpoint.read, Checkpoint.read_index

    def read(self, name, dtype=None):
        tensor = real_read(self, name, dtype)
        if ".experts." in name:
            largest_read.append(tensor.numel())
        return tensor

    def read_index(self, name, index, dtype=None):
        tensor = real_read_index(self, name, index, dtype)
        largest_read.append(tensor.numel())
        return tensor

    monkeypatch.setattr(Checkpoint, "read", read)
    monkeypatch.setattr(Checkpoint, "read_index", read_index)
    model = load_model(folder, CONFIG)
    try:
        one_expert = model.store.layout.nbytes // 4  # float32 elements of one packed expert, at most
        assert largest_read, "experts must come from the checkpoint"
        assert max(largest_read) <= one_expert
    finally:
        model.close()


def test_routed_experts_exist_only_in_the_store(tmp_path):
    model = load_model(make_tiny_model(tmp_path), CONFIG)
    try:
        names = [name for name, _ in model.hf_model.named_parameters()]
        assert not [n for n in names if ".experts." in n]
        experts = [m for m in model.hf_model.modules() if isinstance(m, OffloadedExperts)]
        assert [m.layer for m in experts] == model.store.layer_indices == [0, 1]
        info = model.info()
        assert info.store_nbytes == 16 * info.expert_nbytes
        assert info.resident_nbytes < info.store_nbytes
        assert model.cache.pool.shape == (4 + 1, info.expert_nbytes)  # the slots and a zero row
    finally:
        model.close()


def test_router_logits_are_kept_per_layer(tmp_path):
    model = load_model(make_tiny_model(tmp_path, model_type="deepseek_v2"), CONFIG)
    try:
        ids = torch.arange(5, 17)
        model.forward(ids, model.new_kv_cache())
        # DeepSeek's first layer is dense: only MoE layers are traced.
        assert sorted(model.trace.logits) == model.store.layer_indices == [1, 2]
        for logits in model.trace.logits.values():
            assert logits.shape == (12, model.store.num_experts)
    finally:
        model.close()


def test_anonymous_memory_after_load_is_one_copy_of_the_experts(tmp_path):
    """Private memory grows by about one copy of the experts (plus the resident weights), not two."""
    folder = save_tiny_model(
        build_tiny_model("olmoe", hidden_size=256, intermediate_size=512, num_experts=32), tmp_path
    )
    script = textwrap.dedent(
        f"""
        import torch
        from engine.config import ExpertBudget, OffloadConfig
        from engine.loader import load_model

        def rss_anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024

        # transformers' modeling code and a meta-device build cost ~50 MiB once: warm them first.
        from transformers import AutoConfig, AutoModelForCausalLM
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained({str(folder)!r}))
        before = rss_anon()
        config = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=2))
        model = load_model({str(folder)!r}, config)
        print(rss_anon() - before, model.store.nbytes, model.info().resident_nbytes)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    grown, store, resident = map(int, out.stdout.split())
    assert store > 50 * 2**20
    assert grown < store + resident + 24 * 2**20  # measured: store + ~6 MiB


def test_quantized_experts_are_opt_in_and_announced(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MOE_CHAT_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_model(tmp_path / "model")
    infos = {}
    for expert_dtype in ("native", "int8"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="engine.loader"):
            model = load_model(folder, dataclasses.replace(CONFIG, expert_dtype=expert_dtype))
        model.close()
        infos[expert_dtype] = model.info()
        warned = "outputs differ" in caplog.text
        assert warned == (expert_dtype != "native"), "quantizing changes the outputs: say so, only then"
    assert OffloadConfig().expert_dtype == "native"
    assert infos["int8"].expert_dtype == "int8" and infos["native"].expert_dtype == "native"
    assert infos["int8"].expert_nbytes < infos["native"].expert_nbytes / 2
    assert infos["int8"].cache_slots == infos["native"].cache_slots == 4
