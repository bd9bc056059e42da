"""How long a draft is: the confidence stop, the tokens still wanted, and α kept between replies.

- A draft ends at the first token its drafter gives less than tau (that token is kept and
  verified); `Draft.confident` counts the tokens before it.
- The draft-length controller learns α from confident tokens only, so a draft that keeps
  stopping at unsure tokens does not talk every later draft down.
- A model keeps one controller per speculation setting: the next reply starts from the
  acceptance measured so far, not from the prior.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.generation import generate_text
from engine.sampling import Sampler, SamplingConfig
from engine.speculative.decoder import SpecConfig
from engine.speculative.drafters import Draft, Drafter
from tests.engine.spec_helpers import GREEDY, TinyModels, greedy, load, prompt_for

VOCAB = 10
PRIOR_ALPHA = 0.7  # DraftLengthController's default prior

pytestmark = pytest.mark.usefixtures("one_compute_thread")


class ScriptedDrafter(Drafter):
    """Draft token i is token i, drawn from a distribution whose largest probability is confidences[i]."""

    name = "scripted"

    def __init__(self, confidences: list[float], tau: float, sampling: SamplingConfig = GREEDY):
        super().__init__(Sampler(sampling), tau)
        self.confidences = confidences

    def propose(self, history: torch.Tensor, n: int, target_kv_cache) -> Draft:
        drawn = iter(range(len(self.confidences)))

        def logits_fn(token: int | None) -> torch.Tensor:
            i = next(drawn)
            probs = torch.full((VOCAB,), (1 - self.confidences[i]) / (VOCAB - 1))
            probs[i] = self.confidences[i]
            return probs.log()

        return self._draw(logits_fn, history, n)


@pytest.mark.parametrize(
    ("confidences", "tau", "tokens", "confident"),
    [
        ([0.9, 0.8, 0.2, 0.9], 0.3, 3, 2),  # the unsure third token ends the draft and is kept
        ([0.9, 0.8, 0.2, 0.9], 0.0, 4, 4),  # tau 0: no stop
        ([0.9, 0.2], 0.3, 2, 1),  # unsure at the last position: nothing cut, one token unsure
        ([0.25, 0.9], 0.3, 1, 0),
        ([0.9, 0.9, 0.9], 0.3, 3, 3),
    ],
)
def test_a_draft_ends_at_its_first_unsure_token(confidences, tau, tokens, confident):
    draft = ScriptedDrafter(confidences, tau).propose(torch.tensor([1, 2]), len(confidences), None)
    assert draft.tokens == list(range(tokens))
    assert draft.confident == confident
    assert draft.probs is None


def test_a_sampled_draft_keeps_one_distribution_per_token():
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, top_k=0, seed=3)
    draft = ScriptedDrafter([0.99, 0.99, 0.1, 0.99], 0.3, sampling).propose(torch.tensor([1]), 4, None)
    assert len(draft.tokens) == draft.probs.shape[0] <= 3
    assert draft.confident == min(len(draft.tokens), 2)


# -- with tiny models -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> TinyModels:
    return TinyModels(tmp_path_factory.mktemp("draft-stop"))


@pytest.fixture(scope="module")
def plain(models) -> tuple[int, ...]:
    model = load(models.target("qwen3_moe"))
    try:
        return generate_text(model, prompt_for(0), greedy()).token_ids
    finally:
        model.close()


@pytest.fixture
def target(models):
    model = load(models.target("qwen3_moe"))
    yield model
    model.close()


def controller(model):
    (length,) = model.draft_lengths.values()
    return length


@pytest.mark.parametrize(
    "spec",
    [
        {"mode": "draft", "near": True},
        {"mode": "self", "top_r": 1},
        {"mode": "substitute"},
    ],
    ids=["draft", "self", "substitute"],
)
def test_a_confidence_stop_is_lossless_and_shortens_some_drafts(models, plain, target, spec):
    settings = dict(spec)
    if settings.pop("near", False):
        settings["draft_model"] = str(models.near("qwen3_moe"))
    # tiny random models give their tokens 0.02-0.05: 0.03 ends about half the chains early
    spec = SpecConfig(draft_len=6, adapt_draft_len=False, confidence_tau=0.03, **settings)

    finished = generate_text(target, prompt_for(0), greedy(spec, "spmoe"))

    assert finished.token_ids == plain
    assert finished.stats.draft_len < 6  # every draft of 6 would average 6 (less only at the end)


def test_unsure_tokens_do_not_lower_the_learnt_acceptance(models, plain, target):
    bad = str(models.bad("qwen3_moe"))  # almost every token is rejected
    unsure = SpecConfig(mode="draft", draft_model=bad, confidence_tau=0.99)  # every token is unsure

    finished = generate_text(target, prompt_for(0), greedy(unsure))

    assert finished.token_ids == plain
    assert finished.stats.draft_len == 1  # each draft ends at its first token
    assert controller(target).alpha == pytest.approx(PRIOR_ALPHA)  # nothing confident was judged

    target.draft_lengths.clear()
    sure = dataclasses.replace(unsure, confidence_tau=0.0)
    assert generate_text(target, prompt_for(0), greedy(sure)).token_ids == plain
    assert controller(target).alpha < 0.5


def test_the_next_reply_starts_from_the_acceptance_learnt(models, plain, target):
    own = SpecConfig(mode="draft", draft_model=str(models.target("qwen3_moe")), confidence_tau=0.0)
    first = generate_text(target, prompt_for(0), greedy(own))
    learnt = controller(target).alpha
    second = generate_text(target, prompt_for(0), greedy(own))

    assert first.token_ids == second.token_ids == plain
    assert learnt > PRIOR_ALPHA  # the target as its own draft: every token accepted
    assert controller(target).alpha > learnt
    assert second.stats.draft_len > first.stats.draft_len  # no warm-up from the prior's γ = 4

    generate_text(target, prompt_for(0), greedy(dataclasses.replace(own, draft_len=2)))
    sampled = dataclasses.replace(greedy(own), sampling=SamplingConfig(temperature=0.8))
    generate_text(target, prompt_for(0), sampled)
    assert len(target.draft_lengths) == 3  # another setting, and sampling, learn apart


def test_a_seeded_reply_starts_from_the_prior_and_repeats(models, target):
    own = SpecConfig(mode="draft", draft_model=str(models.target("qwen3_moe")), confidence_tau=0.0)
    seeded = dataclasses.replace(greedy(own), sampling=SamplingConfig(temperature=0.8, seed=5))
    first = generate_text(target, prompt_for(0), seeded)
    unseeded = dataclasses.replace(seeded, sampling=SamplingConfig(temperature=0.8))
    generate_text(target, prompt_for(1), unseeded)  # teaches the model's controller for sampling
    assert generate_text(target, prompt_for(0), seeded).token_ids == first.token_ids
