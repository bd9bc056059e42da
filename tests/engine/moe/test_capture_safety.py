"""A one-token decode step over a cache holding every expert is capture-safe: under FakeTensorMode
(where reading a tensor's value on the host, `int()`, `.tolist()`, `bool()`, or an op whose output
shape depends on values raises) it runs to its logits on every tiny family. That is what a CUDA
graph of the step needs; the GPU tests capture it for real."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from engine.config import ExpertBudget, OffloadConfig
from engine.loader import load_model
from engine.tiny.models import TINY_ARCHITECTURES, make_tiny_model

PROMPT = torch.tensor([3, 5, 7, 9, 11, 13])


def _loaded(folder, experts: ExpertBudget):
    # a simulated link: the experts live in device slots, as on CUDA, not in place in the store
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=experts, sim_link_gbps=1000.0)
    model = load_model(folder, config)
    model.control.grouped = True  # CUDA's default, forced on the CPU
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("capture")
    return {model_type: make_tiny_model(root / model_type, model_type) for model_type in TINY_ARCHITECTURES}


@pytest.mark.parametrize("model_type", TINY_ARCHITECTURES)
def test_a_resident_decode_step_reads_nothing_on_the_host(folders, model_type):
    model = _loaded(folders[model_type], ExpertBudget(all_experts=True))
    try:
        assert model.cache.holds_all and model.cache.fill() == model.store.total_experts
        cache = model.new_kv_cache()
        wanted = model.forward(PROMPT, cache)  # the prefill, for real
        with FakeTensorMode(allow_non_fake_inputs=True):
            logits = model.forward(torch.tensor([17]), cache)
        assert logits.shape == wanted.shape
    finally:
        model.close()


def test_a_step_that_plans_its_copies_on_the_host_is_caught(folders):
    """The control: a cache that cannot hold every expert reads the routes on the host to plan its
    copies — the fake mode raises there, so the test above would see a host read if one came back."""
    model = _loaded(folders["qwen3_moe"], ExpertBudget(experts=8))
    try:
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        with pytest.raises(DataDependentOutputException), FakeTensorMode(allow_non_fake_inputs=True):
            model.forward(torch.tensor([17]), cache)
    finally:
        model.close()
