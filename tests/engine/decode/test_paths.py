"""engine.decode.paths: the one place a step's path is chosen, and the stats that name it."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.decode.paths import GRAPH_PATHS, Step, StepLog
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.tiny.gguf_writer import write_tiny_gguf
from engine.tiny.models import make_tiny_model

needs_ggml = pytest.mark.skipif(not ggml_library.available()[0], reason="ggml's library is not installed")
PROMPT = [3, 17, 42, 99, 7, 25, 11, 64]


def _config(kernels: str) -> OffloadConfig:
    return OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels=kernels
    )


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory):
    """A tiny Q4_K_M-style GGUF whose other matrices are Q8_0: ggml computes every part of a step."""
    return write_tiny_gguf(tmp_path_factory.mktemp("paths"), other_type=QT.Q8_0)


def _greedy(model, new_tokens: int = 8, **settings):
    """`new_tokens` greedy tokens after `PROMPT` (`settings`: GenerationConfig's others)."""
    sampling = SamplingConfig(temperature=0.0)
    config = GenerationConfig(max_new_tokens=new_tokens, sampling=sampling, ignore_eos=True, **settings)
    return generate_text(model, PROMPT, config)


def test_a_step_log_counts_paths_and_says_why_since_a_snapshot():
    log = StepLog()
    log.took("lean", Step(object(), declined=[("ggml-whole", "a hook")]))
    before = log.snapshot()
    for _ in range(3):
        log.took("ggml-replay", Step(object()))
    log.took(
        "lean", Step(object(), declined=[("ggml-replay", "another cache"), ("ggml-whole", "past the limit")])
    )
    since = log.since(before)
    assert since["step_path"] == "ggml-replay" and since["step_paths"] == {"ggml-replay": 3, "lean": 1}
    assert since["step_path_declined"] == {"ggml-replay": "another cache", "ggml-whole": "past the limit"}
    assert log.since(log.snapshot()) == {"step_path": None, "step_paths": {}, "step_path_declined": {}}
    assert log.since(None)["step_paths"] == {"lean": 2, "ggml-replay": 3}


def test_a_step_keeps_at_most_its_tokens_and_makes_a_decode_ids_tensor_once():
    step = Step(object(), keep=0, tokens=torch.tensor([[1, 2, 3]]))
    assert (step.count, step.keep) == (3, 3)
    one = Step(object(), keep=4, token=7)
    assert (one.count, one.keep) == (1, 1) and one.ids() is one.ids() and one.ids().tolist() == [[7]]


def test_the_standard_decoder_goes_lean_and_a_hook_on_the_decoder_sends_it_to_transformers(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m", "qwen3_moe"), _config("exact"))
    assert model.paths.names == ["lean", "transformers"]
    plain = _greedy(model)
    assert plain.stats.step_path == "lean" and plain.stats.step_paths == {"lean": 8}
    assert plain.stats.step_path_declined == {}
    handle = model.hf_model.model.register_forward_hook(lambda *args: None)
    try:
        hooked = _greedy(model)
    finally:
        handle.remove()
    assert hooked.token_ids == plain.token_ids
    assert hooked.stats.step_path == "transformers" and hooked.stats.step_paths == {"transformers": 8}
    assert "hook on the decoder" in hooked.stats.step_path_declined["lean"]


def test_a_family_the_lean_decoder_does_not_reproduce_has_the_transformers_path_alone(tmp_path):
    model = load_model(make_tiny_model(tmp_path / "m", "gpt_oss"), _config("exact"))
    assert model.paths.names == ["transformers"]
    assert _greedy(model, 3).stats.step_paths == {"transformers": 3}


@needs_ggml
def test_ggml_decode_replays_its_one_graph_and_says_why_the_first_steps_did_not(gguf_file):
    model = load_model(gguf_file, _config("ggml"))
    assert model.paths.names == ["ggml-replay", "ggml-whole", "lean+ggml", "transformers"]
    stats = _greedy(model).stats
    # the prefill goes layer by layer (no prompt in the cache for the graph yet), the first decode
    # step through the one graph, which prepares the replays of the rest
    assert stats.step_paths == {"lean+ggml": 1, "ggml-whole": 1, "ggml-replay": 6}
    assert stats.step_path == "ggml-replay"
    assert stats.step_path_declined["ggml-replay"] == "no one-token graph prepared yet"
    assert "holds no prompt yet" in stats.step_path_declined["ggml-whole"]


@needs_ggml
def test_a_prefetch_predictor_sends_self_speculation_off_the_one_graph_and_says_so(gguf_file):
    model = load_model(gguf_file, _config("ggml"))
    plain = _greedy(model)
    spec = _greedy(model, spec=SpecConfig(mode="self", draft_len=2, confidence_tau=0.0), prefetch="spmoe")
    assert spec.token_ids == plain.token_ids  # lossless whatever the path
    assert not set(spec.stats.step_paths) & set(GRAPH_PATHS)
    assert "prefetch predictor" in spec.stats.step_path_declined["ggml-whole"]


@needs_ggml
def test_the_paths_give_the_same_greedy_tokens_whichever_of_them_runs(gguf_file):
    model = load_model(gguf_file, _config("ggml"))
    fastest = _greedy(model, 12)
    paths = model.paths
    model.paths = paths.without(*GRAPH_PATHS)
    try:
        layers = _greedy(model, 12)
    finally:
        model.paths = paths
    assert Counter(layers.stats.step_paths) == Counter({"lean+ggml": 12})
    assert layers.token_ids == fastest.token_ids
