"""engine.decode.captured_step on the CPU: the whole-step graph's body run eagerly by the stand-in
capture (`eager_capture`: its "replay" runs the body again over the same static inputs), against
the model's own steps, on the tiny model of every supported family whose steps it can hold (the
standard decoder's body on the standard families, the model's own modules on the others); and
under FakeTensorMode, where any value read on the host or a shape that depends on one raises
(what a CUDA graph cannot hold). tests/engine/cuda/test_captured_step.py captures it for real."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.config import ExpertBudget, OffloadConfig
from engine.decode.captured_step import CapturedStep, eager_capture
from engine.decode.module_step import ModuleBody
from engine.decode.paths import StepPaths
from engine.decode.step_body import StepBody
from engine.loader import load_model
from engine.model import kv_cache as kv_cache_module
from engine.model.adapters import SUPPORTED_MODEL_TYPES
from engine.moe.control import DraftRouting
from engine.tiny.models import make_tiny_model
from tests.engine.standard_families import STANDARD_FAMILIES

PROMPT = torch.tensor([3, 5, 7, 9, 11, 13])
STEPS = 8  # past the tiny families' sliding window (8 positions) with the prompt
FAMILIES = sorted(SUPPORTED_MODEL_TYPES)
STANDARD = STANDARD_FAMILIES  # the standard body takes their steps, with the fused decoder kernels
# families whose caches hold more than attention positions: their steps stay eager
NOT_CAPTURED = {
    # a sparse-attention indexer's keys
    "axk2",
    "deepseek_v32",
    "glm_moe_dsa",
    "hy_v4",
    # linear-attention or Mamba state
    "granitemoehybrid",
    "inkling_text",
    "lfm2_moe",
    "nemotron_h",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "qwen3_next",
}


def failing_capture(fn, inputs, pool):
    raise RuntimeError("operation not permitted when stream is capturing")


class _Folders(dict):
    """Each family's tiny checkpoint, made when a test first asks for it."""

    def __init__(self, root):
        super().__init__()
        self.root = root

    def __missing__(self, model_type):
        self[model_type] = make_tiny_model(self.root / model_type, model_type)
        return self[model_type]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory.mktemp("captured"))


def _loaded(folder):
    # a simulated link: the experts live in device slots, as on CUDA, not in place in the store
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget(all_experts=True))
    model = load_model(folder, OffloadConfig(**{**config.__dict__, "sim_link_gbps": 1000.0}))
    model.control.grouped = True  # CUDA's default, forced on the CPU
    model.cache.fill()  # as the loader fills a CUDA cache that holds every expert
    return model


def _greedy(model, decode, steps: int = STEPS) -> tuple[list[int], list[torch.Tensor]]:
    """`steps` greedy tokens after PROMPT, each step's logits, through `decode(token, cache)`."""
    cache = model.new_kv_cache()
    token = int(model.forward(PROMPT, cache)[-1].argmax())
    tokens, logits = [token], []
    for _ in range(steps):
        out = decode(token, cache).clone()
        logits.append(out)
        token = int(out.argmax())
        tokens.append(token)
    return tokens, logits


def _with_graph(model, capture=eager_capture) -> CapturedStep | None:
    captured = CapturedStep.of(model, capture=capture)
    if captured is not None:
        model.captured = captured
        model.paths = StepPaths.of(model.hf_model, model.lean, None, captured)
    return captured


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_captured_step_computes_the_models_steps(folders, model_type, monkeypatch):
    # buffers that grow every few positions: the graph is captured again at each new capacity
    monkeypatch.setattr(kv_cache_module, "GROW_MIN_POSITIONS", 3)
    model = _loaded(folders[model_type])
    try:
        want_tokens, want_logits = _greedy(model, model.decode)
        hits_before = model.cache.stats.phases["decode"].hits
        _greedy(model, model.decode)
        hits_eager = model.cache.stats.phases["decode"].hits - hits_before
        captured = _with_graph(model)
        if model_type in NOT_CAPTURED:
            assert captured is None
            return
        body = StepBody if model_type in STANDARD else ModuleBody
        assert type(captured.body) is body and model.paths.names[0] == "cuda-graph"
        hits_before = model.cache.stats.phases["decode"].hits
        tokens, logits = _greedy(model, model.decode)
        assert model.paths.log.counts["cuda-graph"] == STEPS, model.paths.log.reasons
        assert captured.captures >= 2  # the buffers grew
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert model.cache.stats.phases["decode"].hits - hits_before == hits_eager  # the epilogue's count
        assert set(model.trace.logits) >= set(model.experts)  # the routers' logits, recorded
    finally:
        model.close()


@pytest.mark.parametrize("model_type", sorted(set(FAMILIES) - NOT_CAPTURED))
def test_the_step_body_reads_nothing_on_the_host(folders, model_type):
    """What the graph holds runs under FakeTensorMode: no host read, no value-dependent shape."""
    model = _loaded(folders[model_type])
    try:
        captured = CapturedStep.of(model, capture=eager_capture)
        cache = model.new_kv_cache(rewindable=captured.needs_every_position)
        model.forward(PROMPT, cache)
        buffers = tuple(layer.room(1) for layer in cache.layers)
        inputs = captured._inputs(buffers, 17, cache.get_seq_length(), torch.device("cpu"))
        with FakeTensorMode(allow_non_fake_inputs=True):
            logits = captured._run(captured.body, *inputs)
        assert logits.shape == (model.hf_config.get_text_config().vocab_size,)
    finally:
        model.close()


def test_a_failed_capture_falls_back_and_says_why(folders):
    model = _loaded(folders["qwen3_moe"])
    try:
        want_tokens, _ = _greedy(model, model.decode)
        captured = _with_graph(model, capture=failing_capture)
        tokens, _ = _greedy(model, model.decode)
        assert tokens == want_tokens
        assert "operation not permitted" in captured.off_because
        log = model.paths.log
        assert log.counts["cuda-graph"] == 0 and log.declines["cuda-graph"] == STEPS + 1  # the prefill too
        assert "turned off after a failed capture" in log.reasons["cuda-graph"]
    finally:
        model.close()


def test_steps_it_cannot_hold_go_the_eager_way(folders):
    model = _loaded(folders["qwen3_moe"])
    try:
        captured = _with_graph(model)
        cache = model.new_kv_cache()
        assert "no prompt yet" in captured.refusal(cache)
        model.forward(PROMPT, cache)
        assert captured.refusal(cache) == ""
        with model.control.installed(observers=(lambda *args: None,)):
            assert "prefetch predictor" in captured.refusal(cache)
        with model.control.installed(draft=DraftRouting(top_r=1, cached_only=True)):
            assert "the host decides" in captured.refusal(cache)
        with model.control.installed(draft=DraftRouting(top_r=1)):  # SS-MoE's cut, on the device
            assert captured.refusal(cache) == ""
        stored = model.new_kv_cache()
        stored.layers[0] = object()
        assert "not the engine's attention buffers" in captured.refusal(stored)
        model.forward(torch.arange(17), cache)  # more tokens than a verification's graph takes
        assert model.paths.log.reasons["cuda-graph"] == "a step of 17 tokens (graphs take up to 16)"
    finally:
        model.close()


def test_no_graph_off_cuda_unless_a_capture_is_given(folders):
    model = _loaded(folders["qwen3_moe"])
    try:
        assert model.captured is None and "cuda-graph" not in model.paths.names
    finally:
        model.close()


def test_kernels_that_cannot_run_leave_their_pieces_to_the_modules(folders, monkeypatch):
    """A cubin that does not load (here: every launch fails) turns its piece off, not the graph."""
    from engine.decode import fused_decoder

    def fails(self, name, grid, *args):
        raise RuntimeError(f"cuModuleLoadData failed for {name}")

    monkeypatch.setattr(fused_decoder.Launcher, "__call__", fails)
    model = _loaded(folders["qwen3_moe"])
    try:
        want_tokens, _ = _greedy(model, model.decode)
        model.control.fused = True
        captured = _with_graph(model)
        tokens, _ = _greedy(model, model.decode)
        fused = captured.body.fused
        assert (fused.norms, fused.rotary, fused.attention, fused.routers) == (False, False, False, {})
        assert tokens == want_tokens and captured.off_because is None
        assert model.paths.log.counts["cuda-graph"] == STEPS
    finally:
        model.close()
