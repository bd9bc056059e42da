"""engine.bench.graph_check on the CPU, its graph replaced by the stand-in capture that runs the
step's body again (tests/engine/decode/test_captured_step.py): the JSON it writes for a family the
graph takes and for one it does not."""

from __future__ import annotations

import json

from engine.bench import graph_check
from engine.decode.captured_step import CapturedStep, eager_capture
from engine.decode.paths import StepPaths


def _as_on_cuda(model) -> None:
    model.control.grouped = True
    model.cache.fill()
    model.captured = CapturedStep.of(model, capture=eager_capture)
    model.paths = StepPaths.of(model.hf_model, model.lean, None, model.captured)


def test_the_check_compares_the_graph_with_the_eager_step(tmp_path, monkeypatch):
    monkeypatch.setattr(graph_check, "STEPS", 4)
    out = tmp_path / "graph_check.json"
    # a simulated link: the experts live in device slots, as on CUDA, not in place in the store
    families = ["qwen3_moe", "deepseek_v2"]
    graph_check.run(out, "cpu", ["float32"], families, prepare=_as_on_cuda, sim_link_gbps=1000.0)
    families = json.loads(out.read_text())["families"]
    qwen = families["qwen3_moe float32"]
    assert qwen["captured"] and qwen["tokens_equal"] and qwen["off_because"] is None
    assert qwen["max_abs_delta"] <= 1e-5 * qwen["logits_scale"]
    assert qwen["step_paths"]["cuda-graph"] == graph_check.STEPS
    assert families["deepseek_v2 float32"] == {
        "captured": False,
        "why": "the decoder is not the standard one (or not on CUDA)",
    }
