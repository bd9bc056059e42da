"""A reply's logprobs: the distribution each token was drawn from, kept as the step computed it —
equal whether the token came from a plain step or a verified draft, and the greedy token on top."""

import pytest
import torch

from engine.config import OffloadConfig
from engine.generation import generate
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.loader import load_model
from engine.resources import demo_draft_dir, demo_model_dir

STORY = "Tell me a long story about a horse."


@pytest.fixture(scope="module")
def demo():
    model = load_model(demo_model_dir(), OffloadConfig(device="cpu", kernels="exact"))
    yield model
    model.close()


def logprobs_of(model, spec: SpecConfig, sampling: SamplingConfig, top: int = 4):
    config = GenerationConfig(max_new_tokens=40, sampling=sampling, spec=spec, logprobs=top)
    events = list(generate(model, STORY, config))
    tokens = events[:-1]
    return [e.token_id for e in tokens], [e.logprob for e in tokens], events[-1]


@pytest.mark.parametrize(
    "spec",
    [
        SpecConfig(mode="draft", draft_model=str(demo_draft_dir()), draft_len=4),
        SpecConfig(mode="self", top_r=1),
    ],
    ids=["draft", "self"],
)
def test_verified_tokens_have_the_logprobs_plain_steps_give(demo, spec):
    greedy = SamplingConfig(temperature=0, repetition_penalty=1.1)  # a processor: scores, not logits
    plain_ids, plain, _ = logprobs_of(demo, SpecConfig(), greedy)
    spec_ids, verified, finished = logprobs_of(demo, spec, greedy)
    assert finished.stats.accept_len and finished.stats.accept_len > 1, "drafts were accepted"
    assert spec_ids == plain_ids
    for a, b in zip(plain, verified, strict=True):
        assert a.token == b.token and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.top[0][0] == a.token, "greedy: the token is the likeliest"


def test_sampled_logprobs_follow_the_processed_distribution(demo):
    sampling = SamplingConfig(temperature=0.7, top_k=5, seed=3)
    _, logprobs, _ = logprobs_of(demo, SpecConfig(), sampling, top=8)
    for entry in logprobs:
        top = dict(entry.top)
        assert entry.token in top, "top_k=5 leaves only five tokens to draw"
        live = [lp for lp in top.values() if lp > -float("inf")]  # five, and any tied with the fifth
        assert 5 <= len(live) < 8 and torch.tensor(live).exp().sum().item() == pytest.approx(1.0, abs=1e-4)


def test_no_logprobs_unless_asked(demo):
    events = list(generate(demo, STORY, GenerationConfig(max_new_tokens=5)))
    assert all(e.logprob is None for e in events[:-1])
