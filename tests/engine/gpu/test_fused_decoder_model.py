"""The captured step's body through the fused decoder kernels (`engine.decode.fused_decoder`), run
by Triton's interpreter on the CPU with CUDA's layout emulated: on every standard tiny family the
model's greedy tokens and float32 logits to rounding, each piece taken only where its probe
agrees; and a tiny Q4_K/Q6_K GGUF's step counted: kernel launches and torch operators a layer.
Interpreted in a child process (tests/engine/gpu/interpreter.py says why)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.decode.captured_step import CapturedStep, eager_capture
from engine.decode.paths import StepPaths
from engine.resident import weights
from engine.resident.device_blocks import BlocksLinear
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.models import make_tiny_model
from tests.engine.decode.test_captured_step import STANDARD, _greedy, _loaded
from tests.engine.gpu.interpreter import in_the_interpreter, run_in_child_interpreter
from tests.engine.moe.test_fused_experts import load_emulating_cuda

if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

# what each family's probes take: (norms, rotary, attention, router)
PIECES = {
    "qwen3_moe": (True, True, True, True),
    "qwen2_moe": (True, True, True, True),
    "mixtral": (True, True, True, True),
    # q/k norms over the whole projection (of 16-value heads: its tiny model's norms are as wide as
    # the hidden state), so no rotary kernel, and no attention kernel in the interpreter
    "olmoe": (True, False, False, True),
    "phimoe": (False, True, True, False),  # LayerNorm, and a sparse-mixer router
    # routers that are not softmax → top-k → renorm (sigmoid scores, group limits, score biases) and
    # rotations the kernel does not make (partial or interleaved) stay the modules'
    "aria_text": (True, True, True, False),
    "ernie4_5_moe": (True, False, True, False),
    "glm4_moe": (True, False, True, False),
    "hy_v3": (True, True, True, False),
    "minimax_m2": (True, False, True, False),
    "minimax_m3_vl_text": (False, False, True, False),
    "solar_open": (True, True, True, False),
}
# heads of 32 values: the attention kernel's tl.dot sums 16-wide heads wrongly in the interpreter
HEAD_DIMS = {"olmoe": {}}


def test_the_fused_decoder_in_a_child_interpreter() -> None:
    """This module's tests, run by pytest in a process with TRITON_INTERPRET=1 from its start."""
    run_in_child_interpreter(__file__, timeout=600)


def _with_fused_graph(model) -> CapturedStep:
    model.control.fused = True
    captured = model.captured = CapturedStep.of(model, capture=eager_capture)
    model.paths = StepPaths.of(model.hf_model, model.lean, None, captured)
    return captured


@in_the_interpreter
@pytest.mark.parametrize("model_type", sorted(STANDARD))
def test_the_fused_body_gives_the_models_steps(tmp_path, model_type) -> None:
    folder = make_tiny_model(tmp_path / model_type, model_type, **HEAD_DIMS.get(model_type, {"head_dim": 32}))
    model = _loaded(folder)
    try:
        want_tokens, want_logits = _greedy(model, model.decode)
        captured = _with_fused_graph(model)
        tokens, logits = _greedy(model, model.decode)
        fused = captured.body.fused
        assert fused is not None and model.paths.log.counts["cuda-graph"] == len(want_logits)
        routed = len(fused.routers) == len(model.experts)
        assert (fused.norms, fused.rotary, fused.attention, routed) == PIECES[model_type]
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    finally:
        model.close()


@in_the_interpreter
def test_a_gguf_step_launches_few_kernels_a_layer(tmp_path, monkeypatch) -> None:
    """The fused experts, the fused decoder and the matrices in their blocks together (as on
    CUDA): the eager model's greedy tokens, and the launches of one replayed step of a Q4_K/Q6_K
    file with Q8_0 matrices as the graph would hold them."""
    from engine.bench.op_counts import count_ops

    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0)
    plain = load_emulating_cuda(path, monkeypatch)
    want, _ = _greedy(plain, plain.decode)
    plain.close()
    monkeypatch.setattr(weights, "BLOCKS_ON", ("cuda", "cpu"))
    model = load_emulating_cuda(path, monkeypatch)
    try:
        kept = [m for m in model.hf_model.modules() if isinstance(m, BlocksLinear)]
        assert kept
        for module in kept:
            module.gemv = "interpreted"
        _with_fused_graph(model)
        assert _greedy(model, model.decode)[0] == want
        counts = count_ops(model, [3, 17, 42, 99, 7, 250], 4)
        layers = model.hf_config.num_hidden_layers
        assert model.paths.log.counts["cuda-graph"] >= 3
        assert counts["launches"] / layers <= 25, counts
        assert counts["host_syncs"] <= 1.0, counts
    finally:
        model.close()


@in_the_interpreter
def test_the_bench_counts_an_emulated_gpu_step(tmp_path, capsys) -> None:
    """`python -m engine.bench --emulate-cuda --count-ops`: the step's launches, labelled emulated."""
    import json

    from engine.bench.main import main

    path = write_tiny_gguf(tmp_path, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0)
    out = tmp_path / "bench.json"
    argv = ["--model", str(path), "--device", "cpu", "--expert-budget", "all", "--emulate-cuda"]
    argv += ["--count-ops", "--prompts", "1", "--new-tokens", "4", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert "emulated" in result and result["step_graph"]["captures"] >= 1
    assert result["rows"][-1]["step_path"] == "cuda-graph"
    layers = result["model"]["num_layers"]
    assert result["op_counts"]["launches"] / layers <= 25
    assert "emulated: CUDA's layout" in capsys.readouterr().out
