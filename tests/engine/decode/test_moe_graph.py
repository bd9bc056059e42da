"""engine.decode.moe_graph: a MoE block's routing and experts inside the layer's output graph."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.decode import moe_graph as ggml_moe
from engine.decode.moe_graph import RoutedMlp
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.moe.control import DraftRouting
from engine.moe.routing_trace import RoutingTrace
from engine.tiny.gguf_writer import write_tiny_gguf

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")
PROMPT = torch.tensor([3, 17, 42, 99, 7, 25, 11, 64] * 3)


def _load(folder, model_type="qwen3_moe", **overrides):
    path = write_tiny_gguf(
        folder, model_type, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q8_0, **overrides
    )
    config = OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels="ggml"
    )
    return load_model(path, config)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    loaded = _load(tmp_path_factory.mktemp("moe"))
    yield loaded
    loaded.close()


def _inputs(model, tokens: int, seed: int = 3):
    layer = model.lean.layers[1]
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, tokens, model.hf_config.hidden_size, generator=generator)
    attended = torch.randn(1, tokens, layer.ends.heads * layer.head_dim, generator=generator)
    return layer, hidden, attended


@needs_ggml
@pytest.mark.parametrize(("tokens", "rows"), [(1, 1), (3, 3), (4, 1)])
def test_the_graph_computes_what_the_outputs_graph_and_the_block_compute(model, tokens, rows):
    """The layer's output, its experts and its router logits against `outputs` and the block's own
    modules (the same ggml products): equal but for the router's float32 rounding, where a wrong
    rule, weight or sum would be off by the values' own size."""
    assert all(layer.ends.moe is not None for layer in model.lean.layers)
    layer, hidden, attended = _inputs(model, tokens)
    summed, normed = layer.ends.outputs(attended, hidden)
    logits, _, chosen = layer.mlp.gate(normed[0, -rows:])
    wanted = summed[:, -rows:] + layer.mlp(normed[:, -rows:])
    model.trace.clear()
    hits = model.cache.stats.total().hits
    got = layer.ends.finish(attended, hidden, rows)
    assert got.shape == (1, rows, model.hf_config.hidden_size)
    torch.testing.assert_close(got, wanted, rtol=0, atol=1e-5 * wanted.abs().max().item())
    traced = model.trace.logits[layer.ends.moe.experts.layer]
    torch.testing.assert_close(traced, logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(traced.topk(layer.ends.moe.top_k, dim=-1).indices, chosen)
    assert model.cache.stats.total().hits - hits == len(set(chosen.view(-1).tolist()))


@needs_ggml
def test_whatever_watches_the_routes_sends_the_step_through_the_block(model):
    """A hook of someone else's, a predictor or a draft sees the block compute as before."""
    layer, hidden, attended = _inputs(model, 1)
    moe = layer.ends.moe
    assert moe.takes()  # the engine's own routing trace does not count
    seen = []
    handle = layer.mlp.register_forward_hook(lambda *args: seen.append(True))
    try:
        assert not moe.takes() and layer.ends.finish(attended, hidden, 1) is None
    finally:
        handle.remove()
    for module, register in (
        (moe.router, "register_forward_hook"),  # beside the trace's own
        (moe.router, "register_forward_pre_hook"),
        (moe.experts, "register_forward_pre_hook"),
    ):
        handle = getattr(module, register)(lambda *args: None)
        try:
            assert not moe.takes()
        finally:
            handle.remove()
    control = moe.experts.control
    with control.installed(observers=(lambda *args: None,)):
        assert not moe.takes()
    with control.installed(draft=DraftRouting(top_r=1)):
        assert not moe.takes()
    assert moe.takes()


@needs_ggml
def test_the_routers_rule_is_asked_of_it(model, tmp_path, monkeypatch):
    """Renormalizing or not is read off the router; sigmoid scores (DeepSeek's and GLM's rule) or
    a block with a shared expert keep the block's modules."""
    assert model.lean.layers[0].ends.moe.normalizes is model.hf_config.norm_topk_prob
    plain = _load(tmp_path / "plain", norm_topk_prob=not model.hf_config.norm_topk_prob)
    try:
        assert plain.lean.layers[0].ends.moe.normalizes is plain.hf_config.norm_topk_prob
        layer, hidden, attended = _inputs(plain, 2)
        summed, normed = layer.ends.outputs(attended, hidden)
        wanted = summed + layer.mlp(normed)
        got = layer.ends.finish(attended, hidden, 2)
        torch.testing.assert_close(got, wanted, rtol=0, atol=1e-5 * wanted.abs().max().item())
    finally:
        plain.close()
    block = model.lean.layers[0].mlp
    router = block.gate

    def sigmoid_scores(x):
        logits = torch.nn.functional.linear(x, router.weight)
        top, index = logits.sigmoid().topk(router.top_k, dim=-1)
        return logits, top, index

    monkeypatch.setattr(router, "forward", sigmoid_scores)
    assert RoutedMlp.of(block) is None
    monkeypatch.undo()
    shared = _load(tmp_path / "shared", "qwen2_moe")
    try:
        assert all(layer.ends is None or layer.ends.moe is None for layer in shared.lean.layers)
    finally:
        shared.close()


@needs_ggml
def test_a_steps_routes_reach_each_blocks_own_cache_and_trace(model, monkeypatch):
    """A step's blocks sharing the model's cache and trace are counted and traced at once; blocks
    with traces of their own each get theirs, the cache's hits the same."""
    blocks = tuple(layer.ends.moe for layer in model.lean.layers)
    top_k, experts = blocks[0].top_k, blocks[0].num_experts
    chosen = torch.arange(top_k, dtype=torch.int32).expand(len(blocks), 2, top_k).contiguous()
    chosen[:, 1] = torch.arange(1, top_k + 1) % experts  # the second token: one more expert
    logits = torch.randn(len(blocks), 2, experts)
    wanted = (len(blocks) - 1) * len({*range(top_k), top_k % experts}) + top_k  # the last: one row
    for own_traces in (False, True):
        if own_traces:
            for block in blocks:
                monkeypatch.setattr(block.experts, "trace", RoutingTrace())
        hits = model.cache.stats.total().hits
        ggml_moe.record_routes(blocks, chosen.tolist(), logits, 1)
        assert model.cache.stats.total().hits - hits == wanted
        for index, block in enumerate(blocks):
            traced = block.experts.trace.logits[block.experts.layer]
            assert torch.equal(traced, logits[index, : 1 if index == len(blocks) - 1 else 2])


def test_a_steps_router_logits_are_traced_as_the_routers_hooks_would_trace_them():
    """`record_layers` keeps a step's `[L, T, E]` logits whole and gives each layer its rows when
    read (the last layer's kept rows alone); a hook's record, or another set of layers, comes after
    them in order."""
    trace, logits = RoutingTrace(), torch.randn(3, 2, 5)
    trace.record_layers((1, 2, 4), logits, 1)
    assert trace.logits.keys() == {1, 2, 4}
    assert torch.equal(trace.logits[1], logits[0]) and torch.equal(trace.logits[4], logits[2, :1])
    later = torch.randn(3, 2, 5)
    trace.record_layers((1, 2, 4), later, 2)
    trace.record(2, None, None, (torch.ones(2, 5),))  # a router's hook after the step
    assert torch.equal(trace.logits[1], later[0]) and torch.equal(trace.logits[2], torch.ones(2, 5))
    trace.record_layers((1, 2, 4), logits, 2)
    trace.record_layers((7,), later[:1], 2)  # one layer's step: the previous step's layers stay
    assert trace.logits.keys() == {1, 2, 4, 7} and torch.equal(trace.logits[4], logits[2])
    trace.clear()
    assert trace.logits == {}
