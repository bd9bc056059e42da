"""engine.decode.layer_graph: a standard layer's norms, projections and rotation in two ggml graphs."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.decode import graph_chain as ggml_chain
from engine.decode import layer_graph as ggml_layer
from engine.decode.paths import GRAPH_PATHS
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.ggml import graphs as ggml_graphs
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.model import kv_cache
from engine.tiny.gguf_writer import write_tiny_gguf

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")
PROMPT = torch.tensor([3, 17, 42, 99, 7, 25, 11, 64] * 3)


def _load(folder, other_type: QT):
    path = write_tiny_gguf(folder, expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=other_type)
    config = OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels="ggml"
    )
    return load_model(path, config)


@pytest.fixture(scope="module")
def q8_model(tmp_path_factory):
    model = _load(tmp_path_factory.mktemp("q8"), QT.Q8_0)
    yield model
    model.close()


def _ends(model) -> list:
    return [layer.ends for layer in model.lean.layers]


def _without_ends(model, call):
    ends, head, paths = _ends(model), model.lean.head, model.paths
    for layer in model.lean.layers:
        layer.ends = None
    model.lean.head, model.paths = None, paths.without(*GRAPH_PATHS)
    try:
        return call()
    finally:
        for layer, end in zip(model.lean.layers, ends, strict=True):
            layer.ends = end
        model.lean.head, model.paths = head, paths


def _steps(model, tokens=(5, 9, 2, 7)) -> torch.Tensor:
    cache = model.new_kv_cache()
    model.forward(PROMPT, cache)
    return torch.stack([model.forward(torch.tensor([t]), cache)[0] for t in tokens])


@needs_ggml
def test_every_layer_gets_its_graphs_and_they_compute_what_its_modules_do(q8_model):
    """The graphs' query, key, value and outputs against the layer's own modules (whose projections
    are the same ggml kernels): equal to the 8-bit activation rounding both quantize with, where a
    wrong norm, rotation or layout would be off by the values' own size."""
    assert all(end is not None for end in _ends(q8_model))
    layer, hf_layer = q8_model.lean.layers[1], q8_model.hf_model.model.layers[1]
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(1, 3, q8_model.hf_config.hidden_size, generator=generator)
    cos, sin = q8_model.lean.decoder.rotary_emb(hidden, torch.tensor([[4, 5, 6]]))
    attention, heads = hf_layer.self_attn, (1, 3, -1, layer.head_dim)
    x = hf_layer.input_layernorm(hidden)
    query = attention.q_norm(attention.q_proj(x).view(heads)).transpose(1, 2)
    key = attention.k_norm(attention.k_proj(x).view(heads)).transpose(1, 2)
    value = attention.v_proj(x).view(heads).transpose(1, 2)
    wanted = (*q8_model.lean.apply_rotary(query, key, cos, sin), value)
    attended = torch.randn(1, 3, layer.ends.heads * layer.head_dim, generator=generator)
    summed = hidden + attention.o_proj(attended)
    wanted += (summed, hf_layer.post_attention_layernorm(summed))
    got = (*layer.ends.inputs(hidden, cos, sin), *layer.ends.outputs(attended, hidden))
    for a, b in zip(got, wanted, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=0.03 * b.abs().max().item())
    with_graphs = _steps(q8_model)
    with_modules = _without_ends(q8_model, lambda: _steps(q8_model))
    torch.testing.assert_close(with_graphs, with_modules, rtol=0, atol=0.05 * with_modules.abs().max().item())
    assert torch.equal(with_graphs.argmax(-1), with_modules.argmax(-1))


@needs_ggml
def test_the_graphs_compute_row_by_row_whatever_the_token_count(q8_model):
    """A verification's rows are its tokens' one-token rows bit for bit, so speculation verifies
    what decoding would have computed (given the same attention)."""
    end = q8_model.lean.layers[0].ends
    hidden = torch.randn(1, 3, q8_model.hf_config.hidden_size, generator=torch.Generator().manual_seed(1))
    dim = q8_model.lean.layers[0].head_dim
    cos, sin = torch.randn(1, 3, dim), torch.randn(1, 3, dim)
    together = end.inputs(hidden, cos, sin)
    attended = torch.randn(1, 3, end.heads * dim)
    summed, normed = end.outputs(attended, hidden)
    for t in range(3):
        alone = end.inputs(hidden[:, t : t + 1], cos[:, t : t + 1], sin[:, t : t + 1])
        for a, b in zip(alone, together, strict=True):
            assert torch.equal(a[:, :, 0], b[:, :, t])
        one = end.outputs(attended[:, t : t + 1], hidden[:, t : t + 1])
        assert torch.equal(one[0][:, 0], summed[:, t]) and torch.equal(one[1][:, 0], normed[:, t])


@needs_ggml
def test_greedy_tokens_with_the_graphs_are_the_modules_tokens(q8_model):
    """Every graph (the ends, the experts and routes inside `finish`, the head) against the
    layers' and the head's modules."""
    assert all(end.moe is not None for end in _ends(q8_model)) and q8_model.lean.head is not None
    greedy = GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(greedy=True), ignore_eos=True)
    prompt = PROMPT.tolist()
    with_graphs = generate_text(q8_model, prompt, greedy).token_ids
    q8_model.prefix_cache.clear()
    with_modules = _without_ends(q8_model, lambda: generate_text(q8_model, prompt, greedy).token_ids)
    q8_model.prefix_cache.clear()
    assert list(with_graphs) == list(with_modules)


@needs_ggml
def test_a_biased_projection_a_module_norm_or_another_rotation_keeps_the_modules(q8_model, monkeypatch):
    layer = q8_model.lean.layers[0]
    assert ggml_layer.AttentionEnds.of(layer) is not None
    monkeypatch.setattr(layer.q_proj, "bias", torch.nn.Parameter(torch.zeros(layer.q_proj.out_features)))
    assert ggml_layer.AttentionEnds.of(layer) is None
    monkeypatch.undo()
    monkeypatch.setattr(layer, "input_norm", q8_model.hf_model.model.layers[0].input_layernorm)  # the module
    assert ggml_layer.AttentionEnds.of(layer) is None
    monkeypatch.undo()

    def partial_rotation(q, k, cos, sin):  # GLM's: only part of each head turns
        half = q.shape[-1] // 2
        return q * 1, torch.cat([k[..., :half] * cos[:, None, :, :half], k[..., half:]], dim=-1)

    monkeypatch.setattr(q8_model.lean, "apply_rotary", partial_rotation)
    assert not ggml_layer._whole_head_rotation(q8_model.lean)
    assert ggml_layer.attach(q8_model.lean) == 0


@needs_ggml
def test_the_head_graph_computes_the_final_norm_and_lm_head(q8_model):
    """The logits of a few rows against the decoder's norm module and the lm_head (the same ggml
    product); a hook on the lm_head sends the step through the modules again."""
    head, hf = q8_model.lean.head, q8_model.hf_model
    assert head is not None
    hidden = torch.randn(1, 3, q8_model.hf_config.hidden_size, generator=torch.Generator().manual_seed(4))
    wanted = hf.lm_head(hf.model.norm(hidden))[0]
    got = head(hidden)
    assert got.shape == wanted.shape
    torch.testing.assert_close(got, wanted, rtol=0, atol=0.03 * wanted.abs().max().item())
    assert torch.equal(got.argmax(-1), wanted.argmax(-1))
    for row in range(3):  # row by row whatever the count
        assert torch.equal(head(hidden[:, row : row + 1])[0], got[row])
    seen = []
    handle = hf.lm_head.register_forward_hook(lambda *args: seen.append(True))
    try:
        assert head(hidden) is None
        cache = q8_model.new_kv_cache()
        q8_model.forward(PROMPT, cache)
        assert seen
    finally:
        handle.remove()


def _kv(layer) -> tuple[torch.Tensor, torch.Tensor]:
    return layer.keys, layer.values


def _prompted_caches(model, count: int = 2) -> list:
    caches = [model.new_kv_cache() for _ in range(count)]
    for cache in caches:
        model.forward(PROMPT, cache)
    return caches


@needs_ggml
@pytest.mark.parametrize(("tokens", "rows"), [(1, 1), (3, 3), (4, 1)])
def test_a_whole_layer_graph_computes_its_parts_and_torchs_attention(q8_model, monkeypatch, tokens, rows):
    """One graph for the layer — its keys and values written into the cache, ggml's flash
    attention over it — against `inputs`, torch's attention over the same cache and `finish`:
    the same output to float32 rounding and the same cache afterwards."""
    in_graph, in_parts = _prompted_caches(q8_model)
    lean, past = q8_model.lean, len(PROMPT)
    layer = lean.layers[1]
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, tokens, q8_model.hf_config.hidden_size, generator=generator)
    cos, sin = lean.rotary(hidden, past, tokens)
    positions = torch.arange(past, past + tokens)
    mask = None if tokens == 1 else (torch.arange(past + tokens) <= positions[:, None])[None, None]
    with torch.inference_mode():  # as the model's forward runs its layers
        got = layer.ends.whole(hidden, cos, sin, in_graph.layers[1], rows)
        monkeypatch.setattr(ggml_layer.AttentionEnds, "whole", lambda *args: None)
        wanted = layer(hidden, cos, sin, in_parts, lean.apply_rotary, mask, rows)
    assert got.shape == wanted.shape == (1, rows, q8_model.hf_config.hidden_size)
    torch.testing.assert_close(got, wanted, rtol=0, atol=1e-5 * wanted.abs().max().item())
    for a, b in zip(_kv(in_graph.layers[1]), _kv(in_parts.layers[1]), strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


@needs_ggml
def test_a_whole_layer_graph_follows_a_growing_cache_and_steps_aside_before_it(q8_model, monkeypatch):
    """Past the first buffers' room the cache moves to bigger ones and the graph follows them: the
    first layer's keys and values (its input is the embedding alone) equal those of a run through
    torch's attention, position for position. A first step on an empty cache goes through the
    parts (nothing to attend in place yet), as one past `GRAPH_ATTENTION_POSITIONS` does."""
    monkeypatch.setattr(ggml_layer, "GRAPH_ATTENTION_POSITIONS", 10**6)  # to follow a growth
    in_graph, in_parts = _prompted_caches(q8_model)
    layer = in_graph.layers[0]
    first = layer.keys.data_ptr()
    tokens = [(7 * i) % 97 for i in range(kv_cache.GROW_MIN_POSITIONS + 8)]
    for token in tokens:
        q8_model.forward(torch.tensor([token]), in_graph)
    assert layer.keys.data_ptr() != first  # moved to bigger buffers on the way
    monkeypatch.setattr(ggml_layer.AttentionEnds, "whole", lambda *args: None)
    monkeypatch.setattr(q8_model, "paths", q8_model.paths.without(*GRAPH_PATHS))  # nor the step's one graph
    for token in tokens:
        q8_model.forward(torch.tensor([token]), in_parts)
    for a, b in zip(_kv(layer), _kv(in_parts.layers[0]), strict=True):
        assert a.shape[-2] == len(PROMPT) + len(tokens) and torch.equal(a, b)
    monkeypatch.undo()
    hidden = torch.randn(1, 1, q8_model.hf_config.hidden_size)
    cos, sin = q8_model.lean.rotary(hidden, 0, 1)
    ends = q8_model.lean.layers[0].ends
    with torch.inference_mode():
        empty = q8_model.new_kv_cache().layers[0]
        assert ends.whole(hidden, cos, sin, empty, 1) is None
        assert layer.get_seq_length() > ggml_layer.GRAPH_ATTENTION_POSITIONS
        assert ends.whole(hidden, cos, sin, layer, 1) is None  # torch's attention is faster there
        assert q8_model.paths.whole(hidden, cos, sin, in_graph, 1) is None


@needs_ggml
@pytest.mark.parametrize(("tokens", "keep"), [(1, 1), (3, 3), (4, 1)])
def test_one_graph_a_step_computes_the_layer_graphs_bit_for_bit(q8_model, tokens, keep):
    """Every layer's `whole` nodes and the head in one graph give the logits, the cache and the
    routes of the graphs a layer, bit for bit: the same nodes. The experts the step counts in the
    cache are its routers' top-k."""
    lean, paths = q8_model.lean, q8_model.paths
    assert paths.whole is not None
    one_graph, per_layer = _prompted_caches(q8_model)
    ids = torch.tensor([5, 9, 2, 7][:tokens])
    q8_model.trace.clear()
    q8_model.cache.clear()
    got = q8_model.forward(ids, one_graph, logits_to_keep=keep)
    traced, used = dict(q8_model.trace.logits), sorted(q8_model.cache.resident())
    q8_model.paths = paths.without(*GRAPH_PATHS)
    q8_model.cache.clear()
    try:
        wanted = q8_model.forward(ids, per_layer, logits_to_keep=keep)
    finally:
        q8_model.paths = paths
    assert got.shape == (keep, q8_model.hf_config.vocab_size) and torch.equal(got, wanted)
    assert used == sorted(q8_model.cache.resident())
    top_k = lean.layers[0].ends.moe.top_k
    chosen = {layer: logits.topk(top_k).indices.view(-1).tolist() for layer, logits in traced.items()}
    routed = {(layer, e) for layer, experts in chosen.items() for e in experts}
    assert set(used) == routed
    for layer in range(len(lean.layers)):
        assert torch.equal(traced[layer], q8_model.trace.logits[layer])
        for a, b in zip(_kv(one_graph.layers[layer]), _kv(per_layer.layers[layer]), strict=True):
            assert torch.equal(a, b)


@needs_ggml
def test_one_graph_a_step_steps_aside_for_a_hooked_head_or_uneven_caches(q8_model):
    lean, whole = q8_model.lean, q8_model.paths.whole
    hidden = torch.randn(1, 1, q8_model.hf_config.hidden_size)
    cos, sin = lean.rotary(hidden, len(PROMPT), 1)
    (cache,) = _prompted_caches(q8_model, 1)
    with torch.inference_mode():
        handle = q8_model.hf_model.lm_head.register_forward_hook(lambda *args: None)
        try:
            assert whole(hidden, cos, sin, cache, 1) is None
        finally:
            handle.remove()
        cache.layers[0].crop(-1)  # one layer a position short of the others
        assert whole(hidden, cos, sin, cache, 1) is None


def test_new_positions_say_where_each_head_writes_and_what_each_token_sees():
    for length, tokens, capacity, heads in [(0, 1, 5, 2), (4, 1, 5, 4), (24, 1, 280, 4), (3, 3, 8, 2)]:
        where, mask = ggml_chain.new_positions(length, tokens, capacity, heads)
        if tokens == 1:  # a decode step's, rows of tables
            where, mask = where.tensor(), mask.tensor()
        rows = [h * capacity + length + t for t in range(tokens) for h in range(heads)]
        assert where.tolist() == rows
        assert mask.shape == (tokens, capacity) and mask.dtype == torch.float16
        for t in range(tokens):
            seen = mask[t] == 0
            assert seen.tolist() == [p <= length + t for p in range(capacity)]
            assert torch.isinf(mask[t][~seen]).all()


@needs_ggml
def test_a_decode_step_is_one_ggml_call(q8_model, monkeypatch):
    """The standard configuration's decode step (in place, nothing watching the routes, a short
    chat) runs as one kept graph; past the attention's limit it takes the token lookup, two a
    layer and the head."""
    calls = []
    compute = ggml_graphs.KeptGraph.compute
    monkeypatch.setattr(
        ggml_graphs.KeptGraph, "compute", lambda self, *a: calls.append(1) or compute(self, *a)
    )
    (cache,) = _prompted_caches(q8_model, 1)
    calls.clear()
    q8_model.forward(torch.tensor([5]), cache)
    assert len(calls) == 1
    monkeypatch.setattr(ggml_layer, "GRAPH_ATTENTION_POSITIONS", len(PROMPT))
    calls.clear()
    q8_model.forward(torch.tensor([6]), cache)
    assert len(calls) == 1 + 2 * len(q8_model.lean.layers) + 1
