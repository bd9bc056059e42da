"""engine.decode.one_token: a decode step's graph run again on the next token without working its
inputs out again — the step `of_ids` would run, or none."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.decode import graph_chain as ggml_chain
from engine.decode import layer_graph as ggml_layer
from engine.decode import one_token as ggml_decode
from engine.decode.one_token import OneTokenStep
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.tiny.gguf_writer import write_tiny_gguf

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="llama-cpp-python is not installed")
PROMPT = torch.tensor([3, 17, 42, 99, 7, 25, 11, 64] * 2)
TOKENS = (5, 9, 2, 7, 30, 1, 44, 8)
CONFIG = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels="ggml")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(
        tmp_path_factory.mktemp("q4"), expert_type=QT.Q4_K, down_type=QT.Q6_K, other_type=QT.Q4_K
    )
    model = load_model(path, CONFIG)
    yield model
    model.close()


@pytest.fixture
def prepared_steps(monkeypatch) -> list[bool]:
    """Each `OneTokenStep.step` asked: whether it ran the step."""
    asked, step = [], OneTokenStep.step

    def counted(*args):
        logits = step(*args)
        asked.append(logits is not None)
        return logits

    monkeypatch.setattr(OneTokenStep, "step", counted)
    return asked


def _decoded(model, tokens=TOKENS, prepare: bool = True):
    """The logits of each token decoded after the prompt (`OffloadedModel.decode`), the cache, the
    expert cache's decode hits and the routing trace's last router logits; with `prepare` False
    no step is prepared (every one is `of_ids`')."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not prepare:
            monkeypatch.setattr(OneTokenStep, "of", classmethod(lambda cls, *a: None))
        hits = model.cache.stats.phases["decode"].hits
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        logits = torch.stack([model.decode(t, cache).clone() for t in tokens])
    traced = {layer: rows.clone() for layer, rows in model.trace.logits.items()}
    return logits, cache, model.cache.stats.phases["decode"].hits - hits, traced


def _same_caches(ours, theirs) -> bool:
    return all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        for a, b in zip(ours.layers, theirs.layers, strict=True)
    )


@needs_ggml
def test_a_prepared_step_is_the_step_bit_for_bit(model, prepared_steps):
    """From the second decode step on, the prepared step runs each one: the logits, the cache and
    the experts counted are those of `of_ids`' steps, bit for bit."""
    wanted, by_steps, wanted_hits, wanted_trace = _decoded(model, prepare=False)
    prepared_steps.clear()
    got, cache, hits, trace = _decoded(model)
    assert prepared_steps == [True] * (len(TOKENS) - 1)  # the first step prepares the rest
    assert torch.equal(got, wanted) and _same_caches(cache, by_steps) and hits == wanted_hits > 0
    assert trace.keys() == wanted_trace.keys() and len(trace) == 2
    assert all(torch.equal(trace[layer], wanted_trace[layer]) for layer in trace)


@needs_ggml
def test_past_the_graphs_attention_limit_the_step_goes_the_other_way(model, prepared_steps, monkeypatch):
    """Where the cache reaches the one graph's attention limit, neither the prepared step nor the
    graph is asked (a long chat's steps would ask them each token): the steps go layer by layer,
    to the same logits as steps never prepared."""
    monkeypatch.setattr(ggml_layer, "GRAPH_ATTENTION_POSITIONS", len(PROMPT) + 4)
    wanted, by_steps, *_ = _decoded(model, prepare=False)
    prepared_steps.clear()
    got, cache, *_ = _decoded(model)
    assert prepared_steps == [True] * 3  # positions 17 to 19 of 20; from 20 on, not asked
    assert torch.equal(got, wanted) and _same_caches(cache, by_steps)


def _hooked_on_the_third_step(model, module, prepare: bool) -> tuple[torch.Tensor, int, dict]:
    """`_decoded`'s logits with a hook on `module` for the third step only, its calls and the
    paths the third step took (`StepLog.since`)."""
    seen = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        if not prepare:
            monkeypatch.setattr(OneTokenStep, "of", classmethod(lambda cls, *a: None))
        cache = model.new_kv_cache()
        model.forward(PROMPT, cache)
        got = [model.decode(t, cache).clone() for t in TOKENS[:2]]
        handle = module.register_forward_hook(lambda *args: seen.append(1))
        before = model.paths.log.snapshot()
        try:
            got.append(model.decode(TOKENS[2], cache).clone())
        finally:
            handle.remove()
        third = model.paths.log.since(before)
        got += [model.decode(t, cache).clone() for t in TOKENS[3:]]
    return torch.stack(got), len(seen), third


@needs_ggml
@pytest.mark.parametrize("hooked", ["lm_head", "rotary", "experts"])
def test_a_hook_put_on_between_steps_is_called(model, prepared_steps, hooked):
    """A hook put on the lm_head, the rotary module or a MoE block's experts after the step was
    prepared: the replay path declines that step (before it runs, or when its prepared graph
    refuses) and says why, the hook sees it, the next step replays again, and the logits are those
    of steps never prepared (with the hook, the step goes another way: the experts' module
    computes its rows)."""
    module = {
        "lm_head": model.hf_model.lm_head,
        "rotary": model.lean.decoder.rotary_emb,
        "experts": model.lean.decoder.layers[1].mlp.experts,
    }[hooked]
    wanted, wanted_calls, _ = _hooked_on_the_third_step(model, module, prepare=False)
    prepared_steps.clear()
    got, calls, third = _hooked_on_the_third_step(model, module, prepare=True)
    assert third["step_path"] not in ("ggml-replay", None) and "ggml-replay" in third["step_path_declined"]
    assert prepared_steps[0] and prepared_steps[-1] and calls == wanted_calls > 0
    assert torch.equal(got, wanted)


@needs_ggml
def test_another_cache_is_its_own_step(model, prepared_steps):
    """Two caches decoded in turn: a step prepared on one declines the other's, and each cache's
    logits are those it gives alone."""
    wanted, *_ = _decoded(model, TOKENS[:4])
    first, second = model.new_kv_cache(), model.new_kv_cache()
    for cache in (first, second):
        model.forward(PROMPT, cache)
    got = {id(first): [], id(second): []}
    for token in TOKENS[:4]:
        for cache in (first, second):
            got[id(cache)].append(model.decode(token, cache).clone())
    assert all(torch.equal(torch.stack(logits), wanted) for logits in got.values())


@needs_ggml
def test_an_id_outside_the_table_after_a_prepared_step_is_the_modules_error(model):
    cache = model.new_kv_cache()
    model.forward(PROMPT, cache)
    for token in TOKENS[:3]:
        model.decode(token, cache)
    vocab = model.lean.decoder.embed_tokens.num_embeddings
    for token in (vocab, -1):
        with pytest.raises(IndexError):
            model.decode(token, cache)


@needs_ggml
def test_a_step_whose_memories_lie_off_the_lines_is_not_prepared(model):
    """`of` checks each moving memory of the step it ran against the line it would follow: a step
    that read its angles elsewhere (here: one position further) is not prepared."""
    cache = model.new_kv_cache()
    model.forward(PROMPT, cache)
    model.decode(TOKENS[0], cache)
    whole, rotary = model.paths.whole, model.lean.rotary
    ran = ggml_chain.last_ran(whole._cached, (whole._key, True))
    assert OneTokenStep.of(whole, rotary, ran) is not None
    memories = list(ran.memories)
    memories[1] = rotary.at(ran.length + 1, 1)[0]
    assert OneTokenStep.of(whole, rotary, ran._replace(memories=tuple(memories))) is None
    assert ggml_decode.OneTokenStep.of(whole, rotary, None) is None


@needs_ggml
def test_a_reply_on_the_spare_runs_the_last_replys_step_from_its_first(model, prepared_steps):
    """A cleared cache's memory is the next reply's (engine.model.prefix_cache): every decode step
    of that reply runs the graph and the step prepared on the last one, to a fresh cache's tokens."""
    from engine.generation import generate_text
    from engine.prompts import greedy

    model.prefix_cache.close()
    reference = generate_text(model, PROMPT[:9].tolist(), greedy(6))
    generate_text(model, PROMPT.tolist(), greedy(6))
    model.prefix_cache.clear()
    prepared_steps.clear()
    reply = generate_text(model, PROMPT[:9].tolist(), greedy(6))
    assert prepared_steps == [True] * 5 and reply.token_ids == reference.token_ids
