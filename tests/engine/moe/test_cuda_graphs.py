"""`ExpertGraphs` (one CUDA graph a MoE layer) without a GPU: a stand-in capture whose replay
recomputes the step from the static inputs, as a CUDA graph's kernels do, so the buffer plumbing,
recapture and fallback are what is tested. The real capture runs in tests/engine/cuda/test_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.moe.batched_experts import forward_resident
from engine.moe.cuda_graphs import ExpertGraphs
from tests.engine.moe.test_batched_experts import H, _ggml_pool, _module


class StandInGraph:
    def __init__(self, step, inputs, out):
        self.step, self.inputs, self.out = step, inputs, out

    def replay(self) -> None:
        self.out.copy_(self.step(*self.inputs))  # the captured kernels read the static inputs


def stand_in_capture(step, inputs, pool):
    out = step(*inputs)
    return StandInGraph(step, inputs, out), out


def _layer(layer: int = 0):
    layout, pool = _ggml_pool(n_slots=6)
    module = _module()
    module.layer = layer
    module.cache = SimpleNamespace(pool=pool, store=SimpleNamespace(layout_of=lambda _: layout))
    return module, torch.tensor([3, 0, 5, 1, 4, 2])


def _call(seed: int, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, H, generator=generator).to(dtype)
    index = torch.randperm(6, generator=generator)[:3][None]
    return hidden, index, torch.rand(1, 3, generator=generator).to(dtype)


def test_each_step_replays_its_layers_graph_on_its_own_inputs() -> None:
    module, table = _layer()
    graphs = ExpertGraphs(capture=stand_in_capture)
    outputs = []
    for seed in range(4):
        hidden, index, weights = _call(seed)
        out = graphs.forward(module, hidden, index, weights, table)
        assert torch.equal(out, forward_resident(module, hidden, index, weights, table))
        outputs.append((out, out.clone()))
    assert graphs.captures == 1 and graphs.off_because is None
    assert all(torch.equal(out, kept) for out, kept in outputs)  # each step's output is its own


def test_a_new_table_dtype_or_route_count_is_captured_again() -> None:
    module, table = _layer()
    graphs = ExpertGraphs(capture=stand_in_capture)
    graphs.forward(module, *_call(0), table)
    graphs.forward(module, *_call(1), table.clone())  # the cache rebuilt the layer's table
    assert graphs.captures == 2
    hidden, index, weights = _call(2, torch.bfloat16)
    out = graphs.forward(module, hidden, index, weights, table)
    assert graphs.captures == 3 and out.dtype == torch.bfloat16
    hidden, index, weights = _call(3)
    graphs.forward(module, hidden, index[:, :2], weights[:, :2], table)
    assert graphs.captures == 4
    other, other_table = _layer(layer=1)
    graphs.forward(other, *_call(4), other_table)  # each layer has its own
    graphs.forward(module, hidden, index[:, :2], weights[:, :2], table)
    assert graphs.captures == 5


def test_a_failed_capture_turns_the_graphs_off_and_the_eager_path_answers(caplog) -> None:
    attempts = []

    def failing(step, inputs, pool):
        attempts.append(1)
        raise RuntimeError("operation not permitted when stream is capturing")

    module, table = _layer()
    graphs = ExpertGraphs(capture=failing)
    for seed in range(3):
        hidden, index, weights = _call(seed)
        out = graphs.forward(module, hidden, index, weights, table)
        assert torch.equal(out, forward_resident(module, hidden, index, weights, table))
    assert len(attempts) == 1 and "stream is capturing" in graphs.off_because
    assert "Expert CUDA graphs turned off" in caplog.text


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_a_model_decoding_through_the_graphs_matches_transformers(tmp_path, model_type) -> None:
    from transformers import AutoModelForCausalLM

    from engine.config import ExpertBudget, OffloadConfig
    from engine.loader import load_model
    from engine.tiny.models import build_tiny_model, save_tiny_model
    from tests.engine.exactness import assert_matches_reference

    folder = save_tiny_model(build_tiny_model(model_type, seed=1), tmp_path / model_type)
    reference = AutoModelForCausalLM.from_pretrained(folder).eval()
    config = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=16), sim_link_gbps=50.0)
    model = load_model(folder, config)
    try:
        model.cache.fill()
        model.control.grouped = True
        model.control.graphs = graphs = ExpertGraphs(capture=stand_in_capture)
        assert_matches_reference(model, reference, [3, 17, 42, 99, 7, 250, 11, 64])
        assert graphs.captures == len(model.store.layer_indices) and graphs.off_because is None
    finally:
        model.close()
