"""The bundled demo models: present, small, loadable by the engine and transformers alike."""

import argparse

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import GenerationConfig, generate_text
from engine.loader import load_model
from engine.options import model_folder
from engine.resources import demo_draft_dir, demo_model_dir, resources_dir
from engine.sampling import SamplingConfig


def test_shipped_files_fit_the_size_limit():
    folder = resources_dir() / "demo-moe"
    total = sum(p.stat().st_size for name in ("target", "draft") for p in (folder / name).iterdir())
    assert total <= 25 * 2**20
    config = AutoConfig.from_pretrained(demo_model_dir())
    assert config.model_type == "qwen3_moe"
    assert config.num_hidden_layers >= 6 and config.num_experts >= 16 and config.num_experts_per_tok >= 2


def test_the_draft_shares_tokenizer_and_hidden_size():
    target, draft = AutoConfig.from_pretrained(demo_model_dir()), AutoConfig.from_pretrained(demo_draft_dir())
    assert draft.hidden_size == target.hidden_size and draft.vocab_size == target.vocab_size
    assert (demo_draft_dir() / "tokenizer.json").read_bytes() == (
        demo_model_dir() / "tokenizer.json"
    ).read_bytes()


@pytest.fixture(scope="module")
def reference():
    return AutoModelForCausalLM.from_pretrained(demo_model_dir(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def offloaded():
    # A quarter of the 96 routed experts.
    model = load_model(
        demo_model_dir(), OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget(experts=24))
    )
    yield model
    model.close()


def test_engine_matches_transformers_on_the_demo_model(reference, offloaded):
    ids = offloaded.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me about bees."}], add_generation_prompt=True, tokenize=True
    )
    ids = torch.tensor(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    with torch.no_grad():
        expected = reference(ids[None]).logits[0]
    got = offloaded.forward(ids, offloaded.new_kv_cache(), logits_to_keep=0)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        expected_ids = reference.generate(ids[None], max_new_tokens=24, do_sample=False)[0, len(ids) :]
    finished = generate_text(
        offloaded, ids.tolist(), GenerationConfig(max_new_tokens=24, sampling=SamplingConfig(greedy=True))
    )
    assert list(finished.token_ids) == expected_ids.tolist()[: len(finished.token_ids)]


def test_the_draft_loads_with_transformers():
    draft = AutoModelForCausalLM.from_pretrained(demo_draft_dir(), dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(demo_draft_dir())
    logits = draft(**tokenizer("The cat says", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()


def test_the_demo_model_answers_in_english(offloaded):
    reply = generate_text(
        offloaded,
        "What sound does a cow make?",
        GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(greedy=True)),
    )
    assert reply.reason == "eos"
    assert "moo" in reply.text.lower()


def test_the_cli_uses_the_demo_model_when_none_is_given():
    assert model_folder(argparse.Namespace(model=None)) == str(demo_model_dir())
    assert model_folder(argparse.Namespace(model="/x")) == "/x"
