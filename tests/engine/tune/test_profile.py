"""Profiling the bundled demo model (and its draft) on the CPU, experts all resident."""

import itertools
import threading

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import GenerationCancelled
from engine.loader import load_model
from engine.resources import demo_draft_dir, demo_model_dir
from engine.tune.profile import MAX_VERIFY_TOKENS, STAGES, profile_model

LINK_GBPS, LINK_LATENCY_US = 16.0, 10.0


@pytest.fixture(scope="module")
def demo_model():
    config = OffloadConfig(
        device="cpu",
        expert_budget=ExpertBudget.parse("all"),
        sim_link_gbps=LINK_GBPS,
        sim_latency_us=LINK_LATENCY_US,
    )
    model = load_model(demo_model_dir(), config)
    yield model
    model.close()


@pytest.fixture(scope="module")
def profiled(demo_model):
    stages = []
    profile = profile_model(
        demo_model,
        str(demo_draft_dir()),
        progress=lambda stage, done, total: stages.append((stage, done, total)),
    )
    return profile, stages


def test_profile_describes_the_model(demo_model, profiled):
    profile, _ = profiled
    info = demo_model.info()
    assert (profile.model, profile.model_type) == (info.path, "qwen3_moe")
    assert (profile.moe_layers, profile.num_experts, profile.top_k) == (6, 16, 2)
    assert profile.expert_nbytes == info.expert_nbytes
    assert profile.non_expert_bytes == info.resident_nbytes > 0
    assert profile.non_expert_bytes < info.store_nbytes  # the routed experts are not counted


def test_times_are_positive_and_verify_grows_with_tokens(profiled):
    profile, _ = profiled
    assert profile.target_layer_ms > 0
    assert profile.draft_token_ms is not None and profile.draft_token_ms > 0
    assert len(profile.verify_ms) == MAX_VERIFY_TOKENS == 16
    assert all(ms > 0 for ms in profile.verify_ms)
    assert profile.verify_ms[15] > profile.verify_ms[0]


def test_expert_copy_time_is_the_simulated_links(profiled):
    profile, _ = profiled
    expected_ms = LINK_LATENCY_US / 1e3 + profile.expert_nbytes / (LINK_GBPS * 1e9) * 1e3
    assert profile.expert_load_ms == pytest.approx(expected_ms)


def test_kv_bytes_per_token_match_the_config(demo_model, profiled):
    profile, _ = profiled
    cfg = demo_model.hf_config
    itemsize = torch.tensor([], dtype=demo_model.dtype).element_size()
    expected = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2 * itemsize
    assert profile.kv_bytes_per_token == expected


def test_cpu_peak_is_an_estimate_of_weights_drafter_and_kv(demo_model, profiled):
    profile, _ = profiled
    assert profile.context_tokens == 4096
    assert profile.peak_is_estimate
    expected = profile.non_expert_bytes + demo_model.drafter_nbytes() + profile.kv_bytes_per_token * 4096
    assert profile.peak_non_expert_bytes == expected


def test_acceptance_rate_is_a_fraction(profiled):
    profile, _ = profiled
    assert profile.acceptance_rate is not None
    assert 0.0 <= profile.acceptance_rate <= 1.0


def test_progress_reports_every_stage_in_order(profiled):
    _, stages = profiled
    total = len(STAGES)
    assert stages == [(name, i, total) for i, name in enumerate(STAGES)] + [("done", total, total)]


def test_without_a_drafter_draft_fields_are_none(demo_model):
    profile = profile_model(demo_model, None, context_tokens=64)
    assert profile.draft_token_ms is None and profile.acceptance_rate is None
    assert profile.context_tokens == 64
    assert profile.target_layer_ms > 0


def test_cancel_stops_between_stages(demo_model):
    cancel = threading.Event()
    seen = []

    def progress(stage, done, total):
        seen.append(stage)
        if stage == "verify":
            cancel.set()

    with pytest.raises(GenerationCancelled):
        profile_model(demo_model, str(demo_draft_dir()), progress=progress, cancel=cancel)
    assert seen == list(STAGES[: STAGES.index("verify") + 1])


def test_a_cancel_set_before_the_start_measures_nothing(demo_model):
    cancel = threading.Event()
    cancel.set()
    seen = []
    with pytest.raises(GenerationCancelled):
        profile_model(demo_model, progress=lambda *a: seen.append(a), cancel=cancel)
    assert seen == []


@pytest.mark.gpu
def test_cuda_peak_is_measured():
    model = load_model(
        demo_model_dir(), OffloadConfig(device="cuda", expert_budget=ExpertBudget.parse("all"))
    )
    try:
        profile = profile_model(model, str(demo_draft_dir()), context_tokens=512)
    finally:
        model.close()
    assert not profile.peak_is_estimate
    assert profile.peak_non_expert_bytes >= profile.non_expert_bytes + profile.kv_bytes_per_token * 512
    assert profile.expert_load_ms > 0
    assert len(profile.verify_ms) == 16 and all(ms > 0 for ms in profile.verify_ms)


def test_measured_routing_overlap_starts_at_top_k_and_grows_below_the_uniform_model(demo_model, profiled):
    profile, _ = profiled
    measured = profile.unique_experts_measured
    assert measured is not None and len(measured) == MAX_VERIFY_TOKENS
    assert measured[0] == demo_model.top_k  # one token: exactly its top-k
    assert all(a <= b for a, b in itertools.pairwise(measured))
    assert measured[-1] <= profile.num_experts
