"""Speculation with llama.cpp's kernels (`--kernels ggml`) on a tiny Q4_K GGUF: a verification's
batch rounds differently from one-token steps (engine.decode.whole_step), so greedy speculative
output may part from plain greedy's — but only where two tokens are all but tied. Every run that
parts from plain greedy does so at a position whose top two logits (plain decoding's, there) are
within the rounding of a batch; the others are plain greedy's tokens exactly. Sampled, a
verification's distributions are a one-token step's to that rounding."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gguf import GGMLQuantizationType as QT

from engine.config import ExpertBudget, OffloadConfig
from engine.generation import generate_text
from engine.generation_config import SpecConfig
from engine.ggml import library as ggml_library
from engine.loader import load_model
from engine.prompts import greedy
from engine.tiny.gguf_writer import write_tiny_gguf

pytestmark = pytest.mark.skipif(not ggml_library.available()[0], reason="ggml's library cannot run here")

PROMPTS = ([3, 17, 42, 99, 7], [11, 64, 25, 9, 2, 30], [5, 5, 8, 13, 21, 34, 55], [100, 7, 1, 44])
NEW_TOKENS = 40
NEAR_TIE = 1e-4  # of the logits' scale: far above a batch's rounding (~1e-6), far below a real gap


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = write_tiny_gguf(tmp_path_factory.mktemp("ggml-spec"), expert_type=QT.Q4_K, down_type=QT.Q6_K)
    config = OffloadConfig(
        device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("all"), kernels="ggml"
    )
    loaded = load_model(path, config)
    yield loaded
    loaded.close()


def test_greedy_speculation_parts_from_plain_greedy_only_at_near_ties(model):
    spec = SpecConfig(mode="self", draft_len=4, adapt_draft_len=False, confidence_tau=0.0)
    parted = 0
    for prompt in PROMPTS:
        plain = generate_text(model, prompt, greedy(NEW_TOKENS)).token_ids
        drafted = generate_text(model, prompt, replace(greedy(NEW_TOKENS), spec=spec)).token_ids
        if drafted == plain:
            continue
        parted += 1
        at = next(i for i, (a, b) in enumerate(zip(plain, drafted, strict=False)) if a != b)
        logits = model.forward(torch.tensor(prompt + list(plain[:at])), model.new_kv_cache())[-1]
        first, second = logits.float().topk(2).values.tolist()
        assert first - second <= NEAR_TIE * logits.abs().max().item(), (prompt, at, first, second)
        assert drafted[at] in logits.topk(2).indices.tolist()  # the runner-up of a near-tie
    assert parted < len(PROMPTS)  # most runs are plain greedy's tokens exactly


def test_a_verifications_distributions_are_one_token_steps_to_a_batchs_rounding(model):
    """Sampling draws a verification's tokens from its logits; rejection sampling keeps the
    target's distribution whatever the drafts were (tests/engine/speculative/test_acceptance.py
    checks that statistically). So with ggml's kernels, sampled speculation draws from plain
    sampling's distribution as far as a verification's softmax is a one-token step's: here within
    1e-5 in total variation at every position."""
    tokens = [17, 42, 99, 7, 25]
    batch_cache, step_cache = model.new_kv_cache(rewindable=True), model.new_kv_cache(rewindable=True)
    model.forward(torch.tensor(PROMPTS[1]), batch_cache)
    model.forward(torch.tensor(PROMPTS[1]), step_cache)
    batch = model.forward(torch.tensor(tokens), batch_cache, logits_to_keep=0).float().softmax(-1)
    # each step's logits copied before the next step rewrites their buffer
    steps = torch.stack([model.forward(torch.tensor([t]), step_cache)[-1].clone() for t in tokens])
    steps = steps.float().softmax(-1)
    total_variation = 0.5 * (batch - steps).abs().sum(dim=-1)  # [T]
    assert total_variation.max().item() <= 1e-5, total_variation.tolist()
