"""The generation paths on CUDA over an evicting cache: speculative decoding (the model drafting for
itself), each prefetch policy and the hybrid CPU experts give the plain greedy reply, token for token,
and a bf16 model keeps its experts in bf16 on the device.

Every test needs a CUDA device (conftest skips them without one)."""

from __future__ import annotations

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.tiny.models import build_tiny_model, save_tiny_model

pytestmark = pytest.mark.gpu

PROMPT = [3, 17, 42, 99, 7, 250, 11, 64, 5, 90, 31, 8]
GREEDY = GenerationConfig(max_new_tokens=32, sampling=SamplingConfig(greedy=True), ignore_eos=True)
SELF = SpecConfig(mode="self", draft_len=3)


@pytest.fixture(scope="module")
def quarter_cached(tmp_path_factory):
    """The tiny Qwen3-MoE on CUDA with 4 of its 16 experts cached: every path must evict."""
    folder = save_tiny_model(build_tiny_model("qwen3_moe", seed=1), tmp_path_factory.mktemp("qwen3_moe"))
    config = OffloadConfig(device="cuda", dtype="float32", expert_budget=ExpertBudget(experts=4))
    model = load_model(folder, config)
    yield model
    model.close()


@pytest.mark.parametrize(
    ("spec", "prefetch", "cpu_experts"),
    [
        (SELF, "none", "never"),
        (SELF, "spmoe", "never"),
        (SpecConfig(), "next-layer", "never"),
        (SpecConfig(), "hybrimoe", "never"),
        (SpecConfig(), "none", "always"),
    ],
    ids=["self", "self+spmoe", "next-layer", "hybrimoe", "cpu-experts"],
)
def test_each_path_on_cuda_gives_the_plain_greedy_reply(quarter_cached, spec, prefetch, cpu_experts) -> None:
    model = quarter_cached
    plain = generate_text(model, PROMPT, GREEDY)
    misses = model.cache.stats.total().misses
    config = GenerationConfig(
        max_new_tokens=32,
        sampling=SamplingConfig(greedy=True),
        ignore_eos=True,
        spec=spec,
        prefetch=prefetch,
        cpu_experts=cpu_experts,
    )
    finished = generate_text(model, PROMPT, config)
    assert list(finished.token_ids) == list(plain.token_ids)
    assert not finished.stats.simulated_link
    if cpu_experts == "never":
        assert model.cache.stats.total().misses > misses, "the path must have streamed experts"


def test_seeded_sampling_on_cuda_repeats_itself(quarter_cached) -> None:
    sampling = SamplingConfig(temperature=0.9, seed=11)
    seeded = GenerationConfig(max_new_tokens=24, sampling=sampling, ignore_eos=True)
    first = generate_text(quarter_cached, PROMPT, seeded)
    again = generate_text(quarter_cached, PROMPT, seeded)
    assert first.token_ids == again.token_ids


def test_a_bf16_model_on_cuda_keeps_bf16_experts_and_agrees_with_fp32(tmp_path) -> None:
    folder = save_tiny_model(build_tiny_model("qwen3_moe", seed=1), tmp_path / "qwen3_moe")
    ids = torch.tensor(PROMPT)
    logits, expert_nbytes = {}, {}
    for dtype in ("float32", "bfloat16"):
        config = OffloadConfig(device="cuda", dtype=dtype, expert_budget=ExpertBudget(experts=4))
        model = load_model(folder, config)
        try:
            assert model.cache.pool.device.type == "cuda"
            expert_nbytes[dtype] = model.store.expert_nbytes
            logits[dtype] = model.forward(ids, model.new_kv_cache(), logits_to_keep=0).float()
        finally:
            model.close()
    assert expert_nbytes["bfloat16"] * 2 == expert_nbytes["float32"]
    torch.testing.assert_close(logits["bfloat16"], logits["float32"], atol=0.1, rtol=0.05)
    assert logits["bfloat16"][-1].argmax() == logits["float32"][-1].argmax()
