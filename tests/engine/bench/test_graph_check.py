"""engine.bench.graph_check on the CPU, its graph replaced by the stand-in capture that runs the
step's body again (tests/engine/decode/test_captured_step.py): the JSON it writes for a family the
standard body takes, for one whose modules the graph holds and for one it cannot hold; with a budget
that misses, its misses copied in and computed on the CPU."""

from __future__ import annotations

import json

from engine.bench import graph_check
from engine.decode.captured_step import CapturedStep, eager_capture
from engine.decode.paths import StepPaths
from engine.decode.piecewise_step import PiecewiseStep


def _as_on_cuda(model) -> None:
    model.control.grouped = True
    model.cache.fill()
    model.captured = CapturedStep.of(model, capture=eager_capture)
    model.pieces = PiecewiseStep.of(model, model.captured, capture=eager_capture)
    model.paths = StepPaths.of(model.hf_model, model.lean, None, model.captured, model.pieces)


def test_the_check_compares_the_graph_with_the_eager_step(tmp_path, monkeypatch):
    monkeypatch.setattr(graph_check, "STEPS", 4)
    out = tmp_path / "graph_check.json"
    # a simulated link: the experts live in device slots, as on CUDA, not in place in the store
    families = ["qwen3_moe", "deepseek_v2", "qwen3_next"]
    graph_check.run(out, "cpu", ["float32"], families, prepare=_as_on_cuda, sim_link_gbps=1000.0)
    families = json.loads(out.read_text())["families"]
    rows = {
        "qwen3_moe float32": ("StepBody", "cuda-graph"),
        "deepseek_v2 float32": ("ModuleBody", "cuda-graph"),
        "qwen3_moe float32, 6 slots": ("StepBody", "cuda-pieces"),  # a budget that misses
        "deepseek_v2 float32, 6 slots": ("ModuleBody", "cuda-pieces"),
        "qwen3_moe float32, 6 slots, CPU misses": ("StepBody", "cuda-pieces"),  # HybriMoE's split
        "deepseek_v2 float32, 6 slots, CPU misses": ("ModuleBody", "cuda-pieces"),
    }
    for name, (body, path) in rows.items():
        found = families[name]
        assert found["body"] == body and found["captured"] and found["off_because"] is None
        assert found["tokens_equal"] and found["max_abs_delta"] <= 1e-5 * found["logits_scale"]
        assert found["step_paths"][path] == graph_check.STEPS
        assert (found["cpu_computed"] > 0) is name.endswith("CPU misses")
        assert found["tables_mapped"] is (None if path == "cuda-graph" else True)
    assert families["qwen3_next float32"] == {
        "captured": False,
        "why": "layer 0 keeps a LinearAttentionLayer, not attention positions",
    }
