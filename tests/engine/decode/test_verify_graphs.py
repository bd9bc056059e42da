"""Captured steps of a few tokens (a draft's verification: one graph a token count) on the CPU,
through the stand-in capture: on every family the graph holds, chunks of 2–5 tokens after a
prompt, the last of each rejected (cropped) as speculation does, give the model's own forward's
logits; with a budget that misses, as graph pieces (the CPU computing misses too); speculative
decoding whose verifications are replays gives plain greedy's tokens; the body of several tokens
under FakeTensorMode."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from engine.decode.captured_step import CapturedStep, eager_capture
from engine.generation import generate_text
from engine.generation_config import SpecConfig
from engine.model.kv_cache import rewind_cache
from engine.moe.cpu_misses import HybridExecutor
from engine.prompts import greedy
from tests.engine.decode.test_captured_step import (
    FAMILIES,
    NOT_CAPTURED,
    PROMPT,
    _Folders,
    _loaded,
    _with_graph,
)
from tests.engine.decode.test_piecewise_step import _budgeted, _with_pieces

CAPTURED = sorted(set(FAMILIES) - NOT_CAPTURED)
CHUNKS = (3, 2, 5, 3)  # a graph a count; the second 3 replays the first's


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return _Folders(tmp_path_factory.mktemp("verify"))


def _verified(model, chunks=CHUNKS) -> list[torch.Tensor]:
    """The logits `[T, V]` of each chunk of new ids after PROMPT, its last position then cropped."""
    cache = model.new_kv_cache(rewindable=True)
    model.forward(PROMPT, cache)
    ids, logits = iter(range(20, 200)), []
    for count in chunks:
        tokens = torch.tensor([next(ids) for _ in range(count)])
        logits.append(model.forward(tokens, cache, logits_to_keep=0).clone())
        rewind_cache(cache, cache.get_seq_length() - 1)  # the last draft rejected
    return logits


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * b.abs().max().item())


@pytest.mark.parametrize("model_type", CAPTURED)
def test_verification_graphs_compute_the_models_forward(folders, model_type):
    model = _loaded(folders[model_type])
    try:
        want = _verified(model)
        captured = _with_graph(model)
        got = _verified(model)
        assert model.paths.log.counts["cuda-graph"] == len(CHUNKS), model.paths.log.reasons
        assert sorted(count for _, count, _ in captured._graphs) == [2, 3, 5] and captured.captures == 3
        _assert_close(got, want)
    finally:
        model.close()


@pytest.mark.parametrize("cpu_experts", ["never", "always"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v2"])
def test_verification_pieces_compute_the_models_forward(folders, model_type, cpu_experts):
    """6 slots, two experts a token: three tokens' routes fit in the slots, four may not."""
    eager, model = _budgeted(folders[model_type]), _budgeted(folders[model_type])
    try:
        want = _verified(eager, (3, 2, 3, 4))
        pieces = _with_pieces(model)
        with model.control.installed(hybrid=HybridExecutor(model, cpu_experts)):
            got = _verified(model, (3, 2, 3, 4))
        log = model.paths.log
        counts = sorted(count for _, count, _ in pieces._graphs)
        assert log.counts["cuda-pieces"] == 3 and counts == [2, 3], log.reasons
        assert (
            log.reasons["cuda-pieces"]
            == "4 tokens may route to more of a layer's experts than the cache has slots"
        )
        _assert_close(got, want)
        assert (model.cache.stats.phases["decode"].cpu_computed > 0) is (cpu_experts == "always")
        assert not pieces.pieces._pinned
    finally:
        eager.close()
        model.close()


def _self_speculation(draft_len: int, prefetch: str = "none"):
    spec = SpecConfig(mode="self", draft_len=draft_len, adapt_draft_len=False, confidence_tau=0.0)
    cutoff = 1 if prefetch == "spmoe" else None  # both MoE layers predicted
    return replace(greedy(12), spec=spec, prefetch=prefetch, cutoff=cutoff)


def test_speculation_drafts_and_verifies_in_graphs_and_keeps_greedy_tokens(folders):
    """SS-MoE self-drafting: each draft step a replay of the graph captured under its top-r
    routing, each verification a replay of its token count's graph."""
    model = _loaded(folders["qwen3_moe"])
    try:
        plain = generate_text(model, PROMPT.tolist(), greedy(12)).token_ids
        captured = _with_graph(model)
        result = generate_text(model, PROMPT.tolist(), _self_speculation(3))
        assert result.token_ids == plain
        paths = result.stats.step_paths
        assert paths.get("cuda-graph", 0) > 0 and set(paths) <= {"cuda-graph", "lean"}, paths  # lean: prefill
        kinds = {(count, draft is not None) for _, count, draft in captured._graphs}
        assert (1, True) in kinds and (4, False) in kinds, kinds  # a draft's step, a verification
    finally:
        model.close()


def test_speculation_with_prefetch_runs_in_pieces_and_keeps_greedy_tokens(folders):
    """A budget that misses, SP-MoE's predictor watching the drafts: the pieces call it between
    pieces, and the greedy tokens are plain decoding's."""
    eager, model = _budgeted(folders["qwen3_moe"]), _budgeted(folders["qwen3_moe"])
    try:
        plain = generate_text(eager, PROMPT.tolist(), greedy(12)).token_ids
        pieces = _with_pieces(model)
        seen = []
        watch = lambda layer, hidden, top_k: seen.append(layer)  # noqa: E731
        with model.control.installed(observers=(watch,)):
            result = generate_text(model, PROMPT.tolist(), _self_speculation(2, prefetch="spmoe"))
        assert result.token_ids == plain
        assert result.stats.step_paths.get("cuda-pieces", 0) > 0, result.stats.step_path_declined
        assert seen and any(draft is not None for _, _, draft in pieces._graphs)
        stats = result.stats
        assert stats.prefetch.startswith("spmoe") and stats.prefetch_precision is not None, stats
    finally:
        eager.close()
        model.close()


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v2", "gpt_oss"])
def test_the_body_of_several_tokens_reads_nothing_on_the_host(folders, model_type):
    model = _loaded(folders[model_type])
    try:
        captured = CapturedStep.of(model, capture=eager_capture)
        cache = model.new_kv_cache(rewindable=True)
        model.forward(PROMPT, cache)
        buffers = tuple(layer.room(3) for layer in cache.layers)
        tokens = torch.tensor([[17, 18, 19]])
        inputs = captured._inputs(buffers, tokens, cache.get_seq_length(), torch.device("cpu"))
        with model.control.installed(graphed=True), FakeTensorMode(allow_non_fake_inputs=True):
            logits = captured._run(captured.rows, *inputs)
        assert logits.shape == (3, model.hf_config.get_text_config().vocab_size)
    finally:
        model.close()
