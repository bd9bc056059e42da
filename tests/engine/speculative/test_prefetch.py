"""Prefetch policies: the predictors, installing a policy and its accounting.

The predictors are tested alone (a worker that only records) on a 4-layer tiny qwen3_moe,
whose routers are read directly (`x @ W.T`, softmax, top-k) to know which experts each one must ask for.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine.device_cache.expert_cache import STREAM_DEPTH
from engine.errors import InvalidRequestError
from engine.generation import generate_text
from engine.metrics import cache_snapshot, phase_delta
from engine.speculative.decoder import SpecConfig
from engine.speculative.prefetch import (
    HYBRIMOE_DEPTH,
    LayerAheadPredictor,
    PrefetchWorker,
    SpMoePredictor,
    install_prefetch,
)
from tests.engine.spec_helpers import TinyModels, greedy, load, prompt_for

pytestmark = pytest.mark.usefixtures("one_compute_thread")

HIDDEN = 64  # the tiny models' width


# -- predictors ----------------------------------------------------------------------------------


class RecordingWorker:
    """Stands in for PrefetchWorker: keeps what predictors submit."""

    def __init__(self):
        self.tasks: list[tuple[tuple, str]] = []
        self.spare_only: bool | None = None  # of the last task

    def submit(self, keys, phase: str, spare_only: bool = False) -> None:
        keys = tuple(keys)
        if keys:
            self.tasks.append((keys, phase))
        self.spare_only = spare_only

    def discard_pending(self) -> None:
        pass

    @property
    def keys(self) -> list[tuple[int, int]]:
        return [key for keys, _ in self.tasks for key in keys]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("prefetch"))


@pytest.fixture
def deep(models):
    """A 4-layer tiny qwen3_moe: every layer is an MoE layer."""
    model = load(models.target("qwen3_moe", num_hidden_layers=4))
    assert sorted(model.experts) == [0, 1, 2, 3]
    yield model
    model.close()


@pytest.fixture
def roomy(models):
    """The same model with half its experts cached: a one-token step does not stream."""
    model = load(models.target("qwen3_moe", num_hidden_layers=4), experts=16)
    yield model
    model.close()


def router_top_k(model, layer: int, hidden: torch.Tensor) -> list[list[int]]:
    """Each token's top-k experts at `layer`, best first, straight from the router's weights."""
    weight = model.hf_model.get_decoder().layers[layer].mlp.gate.weight  # [E, H]
    probs = torch.softmax(hidden @ weight.T, dim=-1)  # [T, E]
    return probs.topk(model.top_k, dim=-1).indices.tolist()


def test_next_layer_requests_the_next_layers_router_top_k(deep):
    worker = RecordingWorker()
    predictor = LayerAheadPredictor(deep, worker, depth=1)
    hidden = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(0))

    predictor(1, hidden, torch.tensor([[0, 1]]))

    (expected,) = router_top_k(deep, 2, hidden)
    assert worker.tasks == [(tuple((2, e) for e in expected), deep.cache.phase)]


def test_next_layer_requests_every_token_s_experts_not_cached(deep):
    worker = RecordingWorker()
    predictor = LayerAheadPredictor(deep, worker, depth=1)
    hidden = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(1))
    expected = {(1, e) for row in router_top_k(deep, 1, hidden) for e in row}
    cached = min(expected)
    deep.cache.prefetch(cached)

    deep.cache.phase = "verify"
    predictor(0, hidden, torch.tensor([[0, 1]] * 3))

    assert len(worker.tasks) == 1 and worker.tasks[0][1] == "verify"
    assert sorted(worker.keys) == sorted(expected - {cached})  # each once, the cached one left out
    worker.tasks.clear()
    predictor(3, hidden, torch.tensor([[0, 1]] * 3))  # the last MoE layer: nothing ahead
    assert worker.tasks == []


def test_hybrimoe_requests_the_next_three_layers_nearest_first(deep):
    worker = RecordingWorker()
    predictor = LayerAheadPredictor(deep, worker, depth=HYBRIMOE_DEPTH)
    hidden = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(2))

    predictor(0, hidden, torch.tensor([[0, 1]] * 2))

    layers = [layer for layer, _ in worker.keys]
    assert layers == sorted(layers) and set(layers) == {1, 2, 3}
    for layer in (1, 2, 3):
        expected = {(layer, e) for row in router_top_k(deep, layer, hidden) for e in row}
        assert {key for key in worker.keys if key[0] == layer} == expected
    assert len(set(worker.keys)) == len(worker.keys)


def test_spmoe_requests_the_draft_s_routes_up_to_the_cutoff_and_only_while_drafting(deep):
    worker = RecordingWorker()
    predictor = SpMoePredictor(deep, worker, cutoff=1)
    hidden = torch.zeros(2, HIDDEN)
    routes = torch.tensor([[0, 1], [1, 2]])
    for phase in ("prefill", "decode", "verify"):
        deep.cache.phase = phase
        for layer in range(4):
            predictor(layer, hidden, routes)
    assert worker.tasks == []

    deep.cache.phase = "draft"
    for layer in range(4):
        predictor(layer, hidden, routes)
    assert sorted(worker.keys) == [(layer, e) for layer in (0, 1) for e in (0, 1, 2)]
    assert all(phase == "draft" for _, phase in worker.tasks)


def test_spmoe_never_requests_a_key_twice_in_a_step(roomy):
    worker = RecordingWorker()
    predictor = SpMoePredictor(roomy, worker, cutoff=3)
    hidden = torch.zeros(1, HIDDEN)
    roomy.cache.phase = "draft"
    predictor.begin_step()
    assert not predictor.spare_only  # it may evict by the cache policy
    predictor(0, hidden, torch.tensor([[0, 1]]))
    predictor(0, hidden, torch.tensor([[1, 2]]))  # the next draft token: only expert 2 is new
    predictor(0, hidden, torch.tensor([[2, 0]]))
    assert worker.keys == [(0, 0), (0, 1), (0, 2)]

    predictor.begin_step()  # a new step: the same experts are asked for again
    predictor(0, hidden, torch.tensor([[1, 0]]))
    assert worker.keys[3:] == [(0, 1), (0, 0)]


def test_spmoe_on_a_streaming_cache_asks_only_for_its_spare_slots(deep, roomy):
    worker = RecordingWorker()
    predictor = SpMoePredictor(deep, worker, cutoff=3)
    deep.cache.phase = "draft"
    predictor.begin_step(verify_tokens=4)  # ~5 experts a layer: more than its share of the 4 slots
    assert predictor.spare_only
    for layer in range(4):
        predictor(layer, torch.zeros(1, HIDDEN), torch.tensor([[layer, layer + 1]]))
    # The first layer's predictions fill the STREAM_DEPTH spare slots; nothing else is asked for.
    assert worker.keys == [(0, 0), (0, 1)][:STREAM_DEPTH] and worker.spare_only

    roomy_predictor = SpMoePredictor(roomy, RecordingWorker(), cutoff=3)
    assert roomy.cache.kept_share() == 3  # (16 slots - STREAM_DEPTH) over 4 layers, at least
    roomy_predictor.begin_step(verify_tokens=1)  # one token needs its top-2: within its share
    assert not roomy_predictor.spare_only
    roomy_predictor.begin_step(verify_tokens=2)  # ~3.5 experts: more than the 3 it keeps
    assert roomy_predictor.spare_only


def test_spmoe_cutoff_minus_one_requests_nothing(deep):
    worker = RecordingWorker()
    predictor = SpMoePredictor(deep, worker, cutoff=-1)
    deep.cache.phase = "draft"
    for layer in range(4):
        predictor(layer, torch.zeros(1, HIDDEN), torch.tensor([[0, 1]]))
    assert worker.tasks == []


def test_spmoe_routes_a_draft_model_s_residual_stream_through_the_target_routers(models, deep):
    draft = AutoModelForCausalLM.from_pretrained(models.near("qwen3_moe")).eval()  # 2 layers, same width
    worker = RecordingWorker()
    predictor = SpMoePredictor(deep, worker, cutoff=1, draft_model=draft)
    ids = torch.tensor([prompt_for(3, length=5)])
    try:
        deep.cache.phase = "verify"
        with torch.no_grad():
            draft(input_ids=ids)
        assert worker.tasks == []

        deep.cache.phase = "draft"
        predictor.begin_step()
        with torch.no_grad():
            draft(input_ids=ids)
        layers = {layer for layer, _ in worker.keys}
        assert layers and layers <= {0, 1}
        assert len(set(worker.keys)) == len(worker.keys)
        assert all(len([k for k in worker.keys if k[0] == layer]) <= deep.top_k for layer in layers)
    finally:
        predictor.close()
    worker.tasks.clear()
    predictor.begin_step()
    with torch.no_grad():
        draft(input_ids=ids)
    assert worker.tasks == [], "close() removes the hooks on the draft model"


@pytest.mark.parametrize("drafter", ["self", "draft"])
def test_spmoe_in_a_run_asks_only_for_layers_up_to_the_cutoff(models, deep, monkeypatch, drafter):
    requested: list[list[tuple[tuple[int, int], str]]] = []  # per speculative step
    submit, begin_step = PrefetchWorker.submit, SpMoePredictor.begin_step

    def recording_submit(worker, keys, phase, spare_only=False):
        keys = tuple(keys)
        requested[-1].extend((key, phase) for key in keys)
        submit(worker, keys, phase, spare_only)

    def recording_begin_step(predictor, verify_tokens=1):
        requested.append([])
        begin_step(predictor, verify_tokens)

    monkeypatch.setattr(PrefetchWorker, "submit", recording_submit)
    monkeypatch.setattr(SpMoePredictor, "begin_step", recording_begin_step)
    spec = (
        SpecConfig(mode="self", top_r=1, confidence_tau=0.0)
        if drafter == "self"
        else SpecConfig(mode="draft", draft_model=str(models.near("qwen3_moe")), confidence_tau=0.0)
    )

    finished = generate_text(deep, prompt_for(0), greedy(spec, "spmoe", cutoff=1))

    assert finished.stats.prefetch == "spmoe (cutoff 1 of 4 MoE layers)"
    steps = [step for step in requested if step]
    assert steps, "drafting asked for no expert at all"
    for step in steps:
        keys = [key for key, _ in step]
        assert {layer for layer, _ in keys} <= {0, 1}
        assert len(set(keys)) == len(keys)
        assert {phase for _, phase in step} == {"draft"}


# -- install_prefetch ----------------------------------------------------------------------------


@pytest.fixture
def target(models, no_worker_left):
    model = load(models.target("qwen3_moe"))
    yield model
    assert model.control.observers == ()
    model.close()


def test_install_rejects_an_unknown_policy(target):
    with pytest.raises(InvalidRequestError, match="Unknown prefetch policy 'oracle'"):
        install_prefetch(target, "oracle", speculative=True)


def test_spmoe_needs_speculation(target):
    with pytest.raises(InvalidRequestError, match="needs --spec"):
        install_prefetch(target, "spmoe")
    with pytest.raises(InvalidRequestError, match="needs --spec"):
        generate_text(target, prompt_for(0), greedy(prefetch="spmoe"))
    assert target.control.hybrid is None


@pytest.mark.parametrize("cutoff", [-2, 2])
def test_spmoe_rejects_a_cutoff_outside_the_moe_layers(target, cutoff):
    with pytest.raises(InvalidRequestError, match="--cutoff"):
        install_prefetch(target, "spmoe", cutoff=cutoff, speculative=True)


@pytest.mark.parametrize(
    ("policy", "description", "predictor"),
    [
        ("next-layer", "next-layer", LayerAheadPredictor),
        ("hybrimoe", "hybrimoe", LayerAheadPredictor),
        ("spmoe", "spmoe (cutoff 1 of 2 MoE layers, auto)", SpMoePredictor),
    ],
)
def test_install_attaches_one_predictor_and_close_removes_it(target, policy, description, predictor):
    prefetch = install_prefetch(target, policy, speculative=True)
    try:
        assert prefetch.description == description
        assert isinstance(prefetch.predictor, predictor)
        assert target.control.observers == (prefetch.predictor,)
    finally:
        prefetch.close(target)
    assert target.control.observers == ()


def test_spmoe_falls_back_to_next_layer_for_a_draft_of_another_width(models, target, caplog):
    dense = AutoModelForCausalLM.from_pretrained(models.dense(hidden_size=32)).eval()
    with caplog.at_level(logging.WARNING, logger="engine.speculative.prefetch"):
        prefetch = install_prefetch(target, "spmoe", speculative=True, draft_model=dense)
    try:
        assert prefetch.policy == "next-layer"
        assert prefetch.description == "next-layer (spmoe fallback: draft hidden 32 != 64)"
        assert isinstance(prefetch.predictor, LayerAheadPredictor) and prefetch.predictor.depth == 1
        assert "falling back to next-layer" in caplog.text
    finally:
        prefetch.close(target)


def test_spmoe_with_a_draft_of_the_same_width_is_not_a_fallback(models, target):
    draft = AutoModelForCausalLM.from_pretrained(models.near("qwen3_moe")).eval()
    prefetch = install_prefetch(target, "spmoe", cutoff=0, speculative=True, draft_model=draft)
    try:
        assert prefetch.policy == "spmoe" and isinstance(prefetch.predictor, SpMoePredictor)
        assert prefetch.description == "spmoe (cutoff 0 of 2 MoE layers)"
    finally:
        prefetch.close(target)


# -- accounting ----------------------------------------------------------------------------------


class LateWorkerLock:
    """The cache lock, but the prefetch worker only gets it once the prefill is over: a worker
    that falls behind compute, as it does on a busy machine."""

    def __init__(self, cache):
        self.cache, self.lock = cache, cache.lock

    def __enter__(self):
        if threading.current_thread().name == "expert-prefetch":
            deadline = time.monotonic() + 5
            while self.cache.phase == "prefill" and time.monotonic() < deadline:
                time.sleep(0.001)
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def test_prefetches_the_prefill_asked_for_count_in_the_run_stats(target, monkeypatch):
    """Each phase's counters are tagged with their phase, whenever the worker issues them."""
    monkeypatch.setattr(target.cache, "lock", LateWorkerLock(target.cache))
    before = cache_snapshot(target.cache)

    finished = generate_text(target, prompt_for(0), greedy(prefetch="hybrimoe"))

    after = cache_snapshot(target.cache)
    prefill = phase_delta(before, after, "prefill")
    assert prefill.prefetched > 0, "the test needs prefetches issued after the prefill"
    assert finished.stats.prefill.prefetched == prefill.prefetched
    total = sum(phase_delta(before, after, p).prefetch_used for p in after) / sum(
        phase_delta(before, after, p).prefetched for p in after
    )
    assert finished.stats.prefetch_precision == pytest.approx(total)
