"""engine.decode.piecewise_step on the CPU: a one-token step as graph pieces over a device cache
that misses, run by the stand-in capture (`eager_capture`: the body again, the host's work inline
at each cut), against the model's own eager steps — on a standard family (the standard body), on
two whose modules the graph holds; each layer's host synchronisation counted; the pieces under
FakeTensorMode (what the graphs hold reads nothing on the host: the routes are read between them).
tests/engine/cuda captures the pieces for real."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.bench.op_counts import count_ops
from engine.config import ExpertBudget, OffloadConfig
from engine.decode.captured_step import eager_capture
from engine.decode.paths import StepPaths
from engine.decode.piecewise_step import PiecewiseStep
from engine.loader import load_model
from engine.model import kv_cache as kv_cache_module
from tests.engine.decode.test_captured_step import PROMPT, STEPS, _Folders, _greedy, _with_graph

FAMILIES = ("qwen3_moe", "deepseek_v2", "gpt_oss")
SLOTS = 6  # of 16 or 24 experts: every step misses some


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory.mktemp("pieces"))


def _budgeted(folder, slots: int = SLOTS):
    """`folder` on a simulated link with `slots` device slots, experts computed together (CUDA's way)."""
    budget = ExpertBudget.parse(str(slots))
    model = load_model(
        folder, OffloadConfig(device="cpu", dtype="float32", expert_budget=budget, sim_link_gbps=50.0)
    )
    model.control.grouped = True
    return model


def _with_pieces(model) -> PiecewiseStep:
    pieces = model.pieces = PiecewiseStep.of(model, _with_graph(model), capture=eager_capture)
    model.paths = StepPaths.of(model.hf_model, model.lean, None, model.captured, pieces)
    return pieces


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_pieces_compute_the_models_steps(folders, model_type, monkeypatch):
    monkeypatch.setattr(kv_cache_module, "GROW_MIN_POSITIONS", 3)  # recaptures as the buffers grow
    eager, model = _budgeted(folders[model_type]), _budgeted(folders[model_type])
    try:
        want_tokens, want_logits = _greedy(eager, eager.decode)
        pieces = _with_pieces(model)
        assert model.paths.names[:2] == ["cuda-graph", "cuda-pieces"]
        tokens, logits = _greedy(model, model.decode)
        assert model.paths.log.counts["cuda-pieces"] == STEPS, model.paths.log.reasons
        assert "holds every expert" not in model.paths.log.reasons.get("cuda-pieces", "")
        assert pieces.captures >= 2 and pieces.off_because is None
        assert tokens == want_tokens
        for got, want in zip(logits, want_logits, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        used, eager_used = (m.cache.stats.phases["decode"] for m in (model, eager))
        assert used.misses > 0 and used.hits + used.misses == eager_used.hits + eager_used.misses
        assert not pieces.pieces._pinned  # every slot released after a step
        assert pieces.pieces.planned >= len(model.experts) * STEPS and pieces.pieces.plan_us_per_layer > 0
    finally:
        eager.close()
        model.close()


def test_a_token_synchronises_once_a_moe_layer(folders):
    model = _budgeted(folders["qwen3_moe"])
    try:
        _with_pieces(model)
        counts = count_ops(model, PROMPT.tolist(), 3)
        layers = len(model.experts)
        # each layer's routes, and the sampled token (a float32 one's read shows as no sync here)
        assert layers <= counts["host_syncs"] <= layers + 1, counts
        assert model.paths.log.counts["cuda-pieces"] > 0
    finally:
        model.close()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_the_pieces_read_nothing_on_the_host(folders, model_type):
    """The body with a cut at each MoE layer's experts (as captured: the host's work left to the
    replay) runs under FakeTensorMode."""
    model = _budgeted(folders[model_type])
    try:
        pieces = PiecewiseStep.of(model, _with_graph(model), capture=eager_capture)
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        buffers = tuple(layer.room(1) for layer in cache.layers)
        inputs = pieces._inputs(buffers, 17, cache.get_seq_length(), torch.device("cpu"))
        cuts = []
        pieces.pieces.cut = lambda: cuts.append(1)
        with model.control.installed(pieces=pieces.pieces), FakeTensorMode(allow_non_fake_inputs=True):
            logits = pieces._run(*inputs)
        assert logits.shape == (model.hf_config.get_text_config().vocab_size,)
        assert len(cuts) == len(model.experts) and set(pieces.pieces.routes) == set(model.experts)
    finally:
        model.close()


def test_cpu_misses_asked_for_leave_the_step_to_the_eager_path(folders):
    model = _budgeted(folders["qwen3_moe"])
    try:
        pieces = _with_pieces(model)
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        with model.control.installed(hybrid=object()):
            assert "the CPU computes misses" in pieces.refusal(cache)
        assert pieces.refusal(cache) == ""
    finally:
        model.close()


def test_a_cache_holding_every_expert_leaves_the_step_to_the_one_graph(folders):
    model = _budgeted(folders["qwen3_moe"], slots=10_000)
    try:
        model.cache.fill()
        pieces = _with_pieces(model)
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        assert "holds every expert" in pieces.refusal(cache)
        model.decode(5, cache)
        assert model.paths.log.counts["cuda-graph"] == 1
    finally:
        model.close()
