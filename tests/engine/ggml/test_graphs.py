"""engine.ggml.graphs: one-token ggml products keep their graph and give the built graph's values."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.ggml import graphs as ggml_graphs
from engine.ggml import kernels as ggml_kernels
from engine.ggml import library as ggml_library
from engine.tiny.kquant_encode import quantize

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")
OUT, IN = 64, 256


def _blocks(seed: int, ggml_type: QT = QT.Q4_K, rows: int = OUT, width: int = IN) -> torch.Tensor:
    dense = np.random.default_rng(seed).standard_normal((rows, width)).astype(np.float32)
    return torch.from_numpy(quantize(dense, ggml_type)).view(torch.uint8).reshape(rows, -1).clone()


def _kept() -> int:
    graphs = ggml_kernels._state.kept
    return 0 if graphs is None else len(graphs._graphs)


def _built_anew(monkeypatch, call):
    """`call()` with every graph built for the call (nothing kept), as before graphs were kept."""
    with monkeypatch.context() as patch:
        patch.setattr(ggml_kernels, "readable", lambda ggml: False)
        return call()


@needs_ggml
def test_a_one_token_product_keeps_its_graph_and_gives_the_built_graphs_values(monkeypatch):
    blocks = _blocks(0)
    before = _kept()
    for seed in range(4):  # new activations and new output memory at every call
        x = torch.randn(1, IN, generator=torch.Generator().manual_seed(seed))
        got = ggml_kernels.linear(x, blocks, QT.Q4_K, OUT, IN)
        built = _built_anew(monkeypatch, lambda x=x: ggml_kernels.linear(x, blocks, QT.Q4_K, OUT, IN))
        assert torch.equal(got, built)
    assert _kept() == before + 1  # one graph for the weight, reused
    other = _blocks(1)
    x = torch.randn(1, IN)
    assert torch.equal(
        ggml_kernels.linear(x, other, QT.Q4_K, OUT, IN),
        _built_anew(monkeypatch, lambda: ggml_kernels.linear(x, other, QT.Q4_K, OUT, IN)),
    )
    assert _kept() == before + 2  # another weight, another graph
    ggml_kernels.linear(torch.randn(3, IN), blocks, QT.Q4_K, OUT, IN)
    assert _kept() == before + 2  # several tokens: built for the call, not kept


@needs_ggml
def test_one_token_routed_products_keep_their_graphs_and_give_the_built_graphs_values(monkeypatch):
    experts, inter, hidden = 4, 64, 256
    rows = [
        torch.cat(
            [
                _blocks(e, rows=2 * inter, width=hidden).view(-1),
                _blocks(9 + e, QT.Q8_0, hidden, inter).view(-1),
            ]
        )
        for e in range(experts)
    ]
    layer = torch.stack(rows)  # each expert its own weights
    split = _blocks(0, rows=2 * inter, width=hidden).numel()
    fields = (0, int(QT.Q4_K), 2 * inter, hidden), (split, int(QT.Q8_0), hidden, inter)
    for ids in ([[0, 3]], [[2, 1]], [[3, 3]]):  # the same graph, other routes each call
        x = torch.randn(1, hidden)
        swiglu = ggml_kernels.routed_swiglu(x, layer, *fields, ids)
        routed = ggml_kernels.linear_routed(x, layer, fields[0], ids)
        with monkeypatch.context() as patch:  # the same calls with every graph built anew
            patch.setattr(ggml_kernels, "readable", lambda ggml: False)
            assert torch.equal(swiglu, ggml_kernels.routed_swiglu(x, layer, *fields, ids))
            assert torch.equal(routed, ggml_kernels.linear_routed(x, layer, fields[0], ids))


@needs_ggml
def test_past_the_limit_the_oldest_graph_goes_and_comes_back_when_needed(monkeypatch):
    monkeypatch.setattr(ggml_graphs.KeptGraphs, "LIMIT", 2)
    ggml_kernels._state.kept = None  # this thread's graphs start empty
    weights = [_blocks(seed) for seed in range(3)]
    x = torch.randn(1, IN)
    first = [ggml_kernels.linear(x, blocks, QT.Q4_K, OUT, IN) for blocks in weights]
    assert _kept() == 2
    again = [ggml_kernels.linear(x, blocks, QT.Q4_K, OUT, IN) for blocks in weights]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    ggml_kernels._state.kept = None


@needs_ggml
def test_each_thread_keeps_its_own_graphs():
    blocks, x = _blocks(4), torch.randn(1, IN)
    here = ggml_kernels.linear(x, blocks, QT.Q4_K, OUT, IN)
    there = {}

    def other_thread():
        there["before"] = _kept()
        there["value"] = ggml_kernels.linear(x, blocks, QT.Q4_K, OUT, IN)
        there["after"] = _kept()

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert there["before"] == 0 and there["after"] == 1
    assert torch.equal(there["value"], here)


@needs_ggml
def test_a_dropped_graph_frees_its_context(monkeypatch):
    ggml, _ = ggml_library.library()
    freed = []
    real_free = ggml.free
    monkeypatch.setattr(ggml, "free", lambda context: freed.append(context) or real_free(context))
    blocks, rows, out = _blocks(5), torch.randn(1, IN), torch.empty(1, OUT)

    def build(context, bind):
        weight = ggml.new_tensor_2d(context, int(QT.Q4_K), IN, OUT)
        activations = ggml.new_tensor_2d(context, ggml_kernels._F32, IN, 1)
        bind(weight, blocks)
        bind(activations, rows)
        return ggml.mul_mat(context, weight, activations)

    graph = ggml_kernels._keep(ggml, build, (rows, out))
    assert graph.compute(ggml_kernels._backend(ggml), (rows, out)) == 0
    torch.testing.assert_close(out, ggml_kernels.linear(rows, blocks, QT.Q4_K, OUT, IN))
    assert not freed
    del graph
    assert len(freed) == 1


def test_a_threads_own_small_set_of_graphs_keeps_its_newest():
    graphs = ggml_graphs.ThreadsKeptGraphs(2)
    for key in range(3):
        graphs.graphs.keep(key, object())
    assert (
        graphs.graphs.get(0) is None and graphs.graphs.get(1) is not None and graphs.graphs.get(2) is not None
    )
    seen = {}
    thread = threading.Thread(target=lambda: seen.update(other=graphs.graphs.get(2)))
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive() and seen == {"other": None}  # another thread starts with none
