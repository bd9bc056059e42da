"""Llama 4's MoE block rewritten onto the experts interface computes what transformers' block does
(engine.model.adapters.rewrites); the engine's CPU path for misses scales the input as well."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.loader import load_model
from engine.model.adapters.rewrites import InputScaledMoe, rewrite_moe_blocks
from engine.tiny.models import save_tiny_model
from engine.tiny.registry import shrunk_config


@pytest.fixture(scope="module")
def llama4_text():
    config = shrunk_config("llama4").get_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_the_rewritten_block_equals_transformers_block(llama4_text):
    block = llama4_text.model.layers[0].feed_forward
    assert isinstance(block, Llama4TextMoe)
    hidden = torch.randn(1, 7, block.hidden_dim, generator=torch.Generator().manual_seed(1))
    expected, expected_logits = block(hidden)
    rewritten = InputScaledMoe(block)
    got, logits = rewritten(hidden)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, expected_logits)
    names = dict(rewritten.named_parameters())  # the checkpoint's names, the same tensors
    assert {n: p.data_ptr() for n, p in names.items()} == {
        n: p.data_ptr() for n, p in block.named_parameters()
    }


def test_rewriting_a_model_replaces_only_llama4_blocks(llama4_text):
    model = AutoModelForCausalLM.from_config(llama4_text.config).eval()
    model.load_state_dict(llama4_text.state_dict())
    rewrite_moe_blocks(model)
    assert all(isinstance(layer.feed_forward, InputScaledMoe) for layer in model.model.layers)
    prompt = torch.tensor([[5, 9, 200, 31, 7]])
    torch.testing.assert_close(model(prompt).logits, llama4_text(prompt).logits, rtol=1e-4, atol=1e-4)


def test_misses_computed_on_the_cpu_give_transformers_tokens(llama4_text, tmp_path):
    """HybriMoE's CPU path for a miss scales the input too (`cpu_experts="always"`)."""
    folder = save_tiny_model(llama4_text, tmp_path / "llama4")
    config = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("2"))
    prompt = [5, 9, 200, 31, 7, 11]
    greedy = GenerationConfig(max_new_tokens=12, sampling=SamplingConfig(greedy=True), ignore_eos=True)
    expected = llama4_text.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, 6:]
    model = load_model(folder, config)
    try:
        finished = generate_text(model, prompt, dataclasses.replace(greedy, cpu_experts="always"))
        assert model.cache.stats.total().cpu_computed > 0
    finally:
        model.close()
    assert list(finished.token_ids) == expected.tolist()
