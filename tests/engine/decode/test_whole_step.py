"""engine.decode.whole_step: a step's token lookup, layers and head in one ggml graph."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.decode import layer_graph as ggml_layer
from engine.ggml import graphs as ggml_graphs
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.resident import ggml_embedding
from engine.resident.ggml_embedding import GgmlEmbedding
from engine.tiny.gguf_writer import write_tiny_gguf

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")
PROMPT = torch.tensor([3, 17, 42, 99, 7, 25, 11, 64] * 3)
CONFIG = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels="ggml")


def _model(folder, table: QT, monkeypatch, quantized: bool = True):
    """A tiny Q4_K model whose token table (and other matrices) are `table`; kept in its blocks
    (`GgmlEmbedding`, as a large vocabulary's is) when `quantized`, else dequantized at load."""
    if quantized:
        monkeypatch.setattr(ggml_embedding, "MIN_QUANTIZED_EMBEDDING", 0)
    path = write_tiny_gguf(folder, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=table)
    return load_model(path, CONFIG)


def _decoded(model, tokens=(5, 9, 2, 7)) -> tuple[torch.Tensor, object]:
    """The logits of a prompt's prefill and then `tokens` decoded one a step, and the cache."""
    cache = model.new_kv_cache()
    logits = [model.forward(PROMPT, cache)[-1]]
    logits += [model.forward(torch.tensor([t]), cache)[0] for t in tokens]
    return torch.stack(logits), cache


def _decoded_by_module(model) -> tuple[torch.Tensor, object]:
    """`_decoded` with the embedding module looking the tokens up."""
    whole = model.paths.whole
    embedding, whole.embedding = whole.embedding, None
    try:
        return _decoded(model)
    finally:
        whole.embedding = embedding


@needs_ggml
@pytest.mark.parametrize(
    ("table", "quantized", "module"),
    [
        (QT.Q8_0, False, torch.nn.Embedding),  # a small vocabulary's table, dequantized at load
        (QT.Q8_0, True, GgmlEmbedding),
        (QT.Q4_K, True, GgmlEmbedding),
        (QT.BF16, True, GgmlEmbedding),
    ],
)
def test_the_step_looks_its_tokens_up_in_the_graph_as_the_module_does(
    tmp_path, monkeypatch, table, quantized, module
):
    """ggml's get_rows of the table's blocks gives the module's rows bit for bit: the logits and
    the cache of decode steps with the lookup in the graph are those of steps given the module's
    rows."""
    model = _model(tmp_path, table, monkeypatch, quantized)
    try:
        whole = model.paths.whole
        assert type(model.lean.decoder.embed_tokens) is module
        assert whole is not None and whole.embedding is not None and whole.embeds()
        looked_up = []
        of_ids = whole.of_ids
        monkeypatch.setattr(whole, "of_ids", lambda *a: looked_up.append(1) or of_ids(*a))
        with torch.inference_mode():
            got, in_graph = _decoded(model)
            assert len(looked_up) == 4  # every decode step (the prompt goes another way)
            wanted, by_module = _decoded_by_module(model)
        assert torch.equal(got, wanted)
        for ours, theirs in zip(in_graph.layers, by_module.layers, strict=True):
            assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    finally:
        model.close()


@pytest.fixture(scope="module")
def q4_model(tmp_path_factory):
    with pytest.MonkeyPatch.context() as monkeypatch:
        model = _model(tmp_path_factory.mktemp("q4"), QT.Q4_K, monkeypatch)
    yield model
    model.close()


@needs_ggml
def test_an_id_outside_the_table_is_the_modules_error_not_ggmls_abort(q4_model):
    """ggml's get_rows aborts the process on an index outside the table: such an id never reaches
    it, and the module's lookup raises as it always did."""
    vocab = q4_model.lean.decoder.embed_tokens.num_embeddings
    with torch.inference_mode():
        cache = q4_model.new_kv_cache()
        q4_model.forward(PROMPT, cache)
        for ids in ([vocab], [-1], [5, vocab + 3]):
            with pytest.raises(IndexError):
                q4_model.forward(torch.tensor(ids), cache)


@needs_ggml
def test_a_hooked_embedding_is_called_and_the_step_stays_one_graph(q4_model, monkeypatch):
    calls = []
    compute = ggml_graphs.KeptGraph.compute
    monkeypatch.setattr(
        ggml_graphs.KeptGraph, "compute", lambda self, *a: calls.append(1) or compute(self, *a)
    )
    embedding = q4_model.lean.decoder.embed_tokens
    seen = []
    handle = embedding.register_forward_hook(lambda _module, args, _out: seen.append(args[0].tolist()))
    try:
        with torch.inference_mode():
            cache = q4_model.new_kv_cache()
            q4_model.forward(PROMPT, cache)
            calls.clear()
            hooked = q4_model.forward(torch.tensor([5]), cache)
    finally:
        handle.remove()
    assert seen[-1] == [[5]] and len(calls) == 1  # the module's rows, into the step's one graph
    with torch.inference_mode():
        cache = q4_model.new_kv_cache()
        q4_model.forward(PROMPT, cache)
        assert torch.equal(q4_model.forward(torch.tensor([5]), cache), hooked)


@needs_ggml
def test_a_step_from_rows_and_one_from_ids_over_the_same_cache_keep_their_own_graphs(q4_model):
    """A hooked embedding's step (rows into the one graph) and the next unhooked one (ids into it)
    over the same cache: each runs its own kept graph, so the second's logits are those of a run
    that never hooked the module."""
    embedding = q4_model.lean.decoder.embed_tokens
    with torch.inference_mode():
        wanted, _ = _decoded(q4_model, (5, 9))
        cache = q4_model.new_kv_cache()
        got = [q4_model.forward(PROMPT, cache)[-1]]
        handle = embedding.register_forward_hook(lambda *args: None)
        try:
            got.append(q4_model.forward(torch.tensor([5]), cache)[0])
        finally:
            handle.remove()
        got.append(q4_model.forward(torch.tensor([9]), cache)[0])
    assert torch.equal(torch.stack(got), wanted)


@needs_ggml
def test_past_the_graphs_attention_limit_the_lookup_is_a_graph_of_its_own(q4_model, monkeypatch):
    """A long chat's steps go layer by layer (torch's attention): their tokens are still looked up
    by ggml (one small graph, not the module's Python dequantization), to the same logits."""
    monkeypatch.setattr(ggml_layer, "GRAPH_ATTENTION_POSITIONS", len(PROMPT))
    whole = q4_model.paths.whole
    looked_up = []
    lookup = type(whole.embedding).__call__
    monkeypatch.setattr(type(whole.embedding), "__call__", lambda *a: looked_up.append(1) or lookup(*a))
    with torch.inference_mode():
        got, _ = _decoded(q4_model)
        assert len(looked_up) == 4
        wanted, _ = _decoded_by_module(q4_model)
    assert torch.equal(got, wanted)


@needs_ggml
@pytest.mark.parametrize("limit", [None, 2], ids=["one-graph", "past-the-graphs-attention"])
def test_decode_of_a_token_id_is_forwards_step_of_it_outside_inference_mode(q4_model, monkeypatch, limit):
    """`OffloadedModel.decode(id)` (the plain decoder's step) gives `forward([id])`'s logits and
    cache bit for bit: through the one graph from the id as it is (the logits in one buffer step
    after step), and where that graph declines the step (past its attention's positions) through
    `forward`."""
    if limit is not None:
        monkeypatch.setattr(ggml_layer, "GRAPH_ATTENTION_POSITIONS", limit)
    tokens = (5, 9, 2, 7)
    wanted, by_forward = _decoded(q4_model, tokens)
    cache = q4_model.new_kv_cache()
    got = [q4_model.forward(PROMPT, cache)[-1]]
    decoded = [q4_model.decode(t, cache) for t in tokens[:1]]
    got += [decoded[0].clone()] + [q4_model.decode(t, cache).clone() for t in tokens[1:]]
    assert not torch.is_inference_mode_enabled()
    assert torch.equal(torch.stack(got), wanted)
    for ours, theirs in zip(cache.layers, by_forward.layers, strict=True):
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)
    # in the one graph each step's logits are written where the last step's were: read before the next
    assert (decoded[0].data_ptr() == q4_model.decode(5, cache).data_ptr()) == (limit is None)
    vocab = q4_model.lean.decoder.embed_tokens.num_embeddings
    with pytest.raises(IndexError):  # an id outside the table: the module's error, as forward's
        q4_model.decode(vocab, cache)
