"""`--spec mtp` drafts with the checkpoint's own MTP layer and never changes the output (issue 20).

Tiny deepseek_v3 (nextn layer at `model.layers.{N}`) and qwen3_5_moe (vision-language checkpoint
with `mtp.*`, Gated DeltaNet target) checkpoints carry MTP weights under their published names
(tests/engine/speculative/mtp_checkpoints.py). A random MTP layer is rejected nearly always and
greedy output stays plain greedy's; an MTP layer built to predict the target's next token exactly
is accepted every time; after rejections the MTP's own KV cache holds exactly what catching up on
the committed tokens from scratch gives.
"""

from __future__ import annotations

import pytest
import torch

from engine.config import ExpertBudget, OffloadConfig
from engine.errors import InvalidRequestError
from engine.generation import generate_text
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.sampling import Sampler
from engine.speculative.auto import resolve
from engine.speculative.decoder import open_decoder
from engine.speculative.mtp import MtpDrafter
from tests.engine.spec_helpers import TinyModels, prompt_for
from tests.engine.speculative.mtp_checkpoints import save_with_mtp

pytestmark = pytest.mark.usefixtures("one_compute_thread")

FAMILIES = ("deepseek_v3", "qwen3_5_moe")
NEW_TOKENS = 24
GREEDY = {"max_new_tokens": NEW_TOKENS, "sampling": SamplingConfig(greedy=True), "ignore_eos": True}
MTP = SpecConfig(mode="mtp", draft_len=3, confidence_tau=0.0)


def _load(folder):
    offload = OffloadConfig(device="cpu", dtype="float32", expert_budget=ExpertBudget.parse("4"))
    return load_model(folder, offload)


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """(model_type, perfect) -> the loaded tiny model with MTP weights, each loaded once."""
    loaded = {}

    def get(model_type: str, perfect: bool = False):
        if (model_type, perfect) not in loaded:
            folder = tmp_path_factory.mktemp(f"{model_type}-{'perfect' if perfect else 'random'}")
            loaded[model_type, perfect] = _load(save_with_mtp(model_type, folder, perfect))
        return loaded[model_type, perfect]

    yield get
    for model in loaded.values():
        model.close()


@pytest.mark.parametrize("model_type", FAMILIES)
def test_greedy_mtp_speculation_is_plain_greedy(mtp_models, model_type):
    model = mtp_models(model_type)
    plain = generate_text(model, prompt_for(0, 12), GenerationConfig(**GREEDY))
    speculative = generate_text(model, prompt_for(0, 12), GenerationConfig(**GREEDY, spec=MTP))
    assert speculative.stats.verify_steps > 0 and speculative.stats.draft_len > 0
    assert speculative.stats.acceptance_rate < 0.5  # a random MTP layer: rejections, rewinds
    assert list(speculative.token_ids) == list(plain.token_ids)


@pytest.mark.parametrize("model_type", FAMILIES)
def test_an_mtp_layer_that_predicts_the_target_is_always_accepted(mtp_models, model_type):
    model = mtp_models(model_type, perfect=True)
    prompt = prompt_for(3, 12)
    plain = generate_text(model, prompt, GenerationConfig(**GREEDY)).token_ids
    assert len(set(plain)) >= 6, "the bigram target should not settle at once: a shifted draft would pass"
    speculative = generate_text(model, prompt, GenerationConfig(**GREEDY, spec=MTP))
    assert list(speculative.token_ids) == list(plain)
    assert speculative.stats.acceptance_rate == 1.0
    assert speculative.stats.accept_len > 3  # the draft length grows while everything is accepted


def test_the_mtp_cache_after_rejections_is_the_one_the_committed_tokens_give(mtp_models):
    model = mtp_models("qwen3_5_moe")  # Gated DeltaNet target: its state is restored and re-fed too
    sampler = Sampler(SamplingConfig(greedy=True), device=model.device)
    fixed = SpecConfig(mode="mtp", draft_len=3, confidence_tau=0.0, adapt_draft_len=False)
    decoder = open_decoder(model, fixed, "none", None, sampler)
    try:
        kv_cache = model.new_kv_cache(rewindable=True)
        history = torch.tensor(prompt_for(1, 12))
        history = torch.cat(
            [history, history.new_tensor([sampler.sample(model.forward(history, kv_cache)[-1], history)])]
        )
        for _ in range(5):
            committed = kv_cache.get_seq_length()
            history = torch.cat([history, history.new_tensor(decoder.step(history, kv_cache))])
            drafter = decoder.drafter
            assert drafter.base + drafter.exact == committed == drafter.kv_cache.get_seq_length()
        assert decoder.counters.accepted < decoder.counters.drafted  # rejections were rewound
        fresh = MtpDrafter(model, sampler)
        try:
            model.forward(history[:committed], model.new_kv_cache())  # the target's states, recorded
            fresh.propose(history[: committed + 1], 1, _Length(committed))
            fresh.rewind(committed)
            kept, rebuilt = drafter.kv_cache.layers[0], fresh.kv_cache.layers[0]
            torch.testing.assert_close(kept.keys, rebuilt.keys, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(kept.values, rebuilt.values, atol=1e-5, rtol=1e-4)
        finally:
            fresh.close()
    finally:
        decoder.close()


class _Length:
    """A stand-in for the target's KV cache that only says how long it is."""

    def __init__(self, length: int):
        self.length = length

    def get_seq_length(self) -> int:
        return self.length


def test_sampled_mtp_speculation_runs_with_its_draft_distributions(mtp_models):
    model = mtp_models("deepseek_v3")
    sampling = SamplingConfig(temperature=0.8, seed=5)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, sampling=sampling, ignore_eos=True, spec=MTP)
    first = generate_text(model, prompt_for(2, 12), config)
    again = generate_text(model, prompt_for(2, 12), config)
    assert len(first.token_ids) == NEW_TOKENS and first.stats.verify_steps > 0
    assert first.token_ids == again.token_ids  # seeded: the same reply


@pytest.fixture(scope="module")
def no_mtp_model(tmp_path_factory):
    model = _load(TinyModels(tmp_path_factory.mktemp("plain")).target("deepseek_v3"))
    yield model
    model.close()


def test_spec_mtp_on_a_checkpoint_without_mtp_weights_says_so(no_mtp_model):
    config = GenerationConfig(**GREEDY, spec=MTP)
    with pytest.raises(InvalidRequestError, match=r"multi-token-prediction layer.*has none"):
        generate_text(no_mtp_model, prompt_for(0, 12), config)


def test_auto_drafts_with_the_mtp_layer_when_the_checkpoint_has_one(mtp_models, no_mtp_model):
    auto = SpecConfig(mode="auto")
    assert resolve(mtp_models("qwen3_5_moe"), auto, "auto", None).spec.mode == "mtp"
    chosen = resolve(mtp_models("deepseek_v3"), auto, "auto", None)
    assert (chosen.spec.mode, chosen.prefetch) == ("mtp", "spmoe")
    assert resolve(no_mtp_model, auto, "auto", None).spec.mode == "self"
