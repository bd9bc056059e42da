"""The whole decode step as one CUDA graph (engine.decode.captured_step), for real: on every tiny
family with the standard decoder and on three whose modules the graph holds (MLA, sinks with
sliding windows, multipliers), a model that holds every expert on the GPU decodes through the
graph (`stats.step_path` "cuda-graph") the same greedy tokens as the eager path, with logits to
float32 rounding, and a replayed step synchronises nothing with the host.

Every test needs a CUDA device (conftest skips them without one)."""

from __future__ import annotations

import pytest
import torch

from engine.bench import graph_check
from engine.bench.graph_check import check_family
from engine.config import ExpertBudget, OffloadConfig
from engine.device_cache.mapped_table import MappedTable, device_view
from engine.loader import load_model
from engine.tiny.models import make_tiny_model

pytestmark = pytest.mark.gpu

PROMPT = torch.tensor([3, 5, 7, 9, 11, 13])
STANDARD = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "phimoe")
MODULES = ("deepseek_v3", "gpt_oss", "granitemoe")  # the rest: `python -m engine.bench.graph_check`


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model_type", STANDARD + MODULES)
def test_the_graph_decodes_the_eager_tokens(tmp_path, model_type, dtype):
    found = check_family(make_tiny_model(tmp_path / model_type, model_type), "cuda", dtype)
    assert found["captured"] and found["off_because"] is None, found
    assert _graphed(found, "cuda-graph"), found
    assert found["tokens_equal"], found
    rtol = 1e-4 if dtype == "float32" else 2e-2
    assert found["max_abs_delta"] <= rtol * found["logits_scale"], found


def test_a_replayed_step_synchronises_nothing(tmp_path):
    folder = make_tiny_model(tmp_path / "qwen3_moe", "qwen3_moe")
    config = OffloadConfig(device="cuda", dtype="bfloat16", expert_budget=ExpertBudget(all_experts=True))
    model = load_model(folder, config)
    try:
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        model.decode(17, cache)  # captured here
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for token in (18, 19, 20):
                model.decode(token, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert model.paths.log.counts["cuda-graph"] == 4
    finally:
        model.close()


@pytest.mark.parametrize("cpu_experts", [None, "always"])
@pytest.mark.parametrize("model_type", ("qwen3_moe", "deepseek_v3", "gpt_oss"))
def test_with_a_budget_the_pieces_decode_the_eager_tokens(tmp_path, model_type, cpu_experts):
    """A cache that misses: each one-token step as graph pieces, the routes read and the misses
    copied in between them (engine.decode.piecewise_step) — or computed on the CPU while the GPU
    computes the hits — gives the all-GPU eager step's tokens, the slot tables read by the GPU
    in pinned host memory."""
    folder = make_tiny_model(tmp_path / model_type, model_type)
    found = check_family(folder, "cuda", "float32", slots=graph_check.BUDGET_SLOTS, cpu_experts=cpu_experts)
    assert found["captured"] and found["off_because"] is None, found
    assert _graphed(found, "cuda-pieces"), found
    assert found["tokens_equal"], found
    assert found["max_abs_delta"] <= 1e-4 * found["logits_scale"], found
    assert found["tables_mapped"], found
    assert (found["cpu_computed"] > 0) is (cpu_experts is not None), found


def test_a_mapped_table_is_read_by_a_replayed_graph_where_it_lies():
    table = MappedTable(8, torch.device("cuda"))
    assert table.mapped and table.device_view.is_cuda
    out = torch.empty(8, dtype=torch.int64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(table.device_view * 2)
    for values in (list(range(1, 9)), list(range(8, 0, -1))):
        table.write(range(8), values)  # a host store: nothing launched
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == [2 * v for v in values]


def _graphed(found: dict, path: str) -> bool:
    """Whether every decode step took `path` (the prefill takes the model's own multi-token path)."""
    paths = found["step_paths"]
    return paths.get(path) == graph_check.STEPS and sum(paths.values()) == graph_check.STEPS + 1


@pytest.mark.parametrize("slots", [None, graph_check.BUDGET_SLOTS])
@pytest.mark.parametrize("model_type", ("qwen3_moe", "deepseek_v3", "gpt_oss"))
def test_verification_graphs_give_the_eager_forwards_logits(tmp_path, model_type, slots):
    """Steps of 2–3 tokens (a draft's verification) replayed as graphs — one a token count, whole
    or in pieces — give the eager multi-token forward's logits; the replays synchronise with the
    host only in the pieces (a layer's routes)."""
    folder = make_tiny_model(tmp_path / model_type, model_type)
    budget = ExpertBudget(all_experts=True) if slots is None else ExpertBudget.parse(str(slots))
    model = load_model(folder, OffloadConfig(device="cuda", dtype="float32", expert_budget=budget))
    try:
        graphed = model.paths
        chunks = [torch.tensor([20 + i, 40 + i, 60 + i][: 2 + i % 2]) for i in range(4)]
        got, want = [], []
        for paths, out in ((graphed, got), (graphed.without("cuda-graph", "cuda-pieces"), want)):
            model.paths = paths
            cache = model.new_kv_cache(rewindable=True)
            model.forward(PROMPT, cache)
            for ids in chunks:
                out.append(model.forward(ids, cache, logits_to_keep=0).float().cpu())
        model.paths = graphed
        path = "cuda-graph" if slots is None else "cuda-pieces"
        assert graphed.log.counts[path] == len(chunks), graphed.log.reasons
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4 * b.abs().max().item())
    finally:
        model.close()


def test_a_device_view_reads_pinned_host_memory_where_it_lies():
    host = torch.arange(1 << 16, dtype=torch.float32).pin_memory()
    view = device_view(host, torch.device("cuda"))
    assert view is not None and view.is_cuda and view.data_ptr() == host.data_ptr()
    assert view.sum().item() == host.sum().item()
    host[7] = -1.0  # a host store, read by the next kernel
    assert view[7].item() == -1.0
