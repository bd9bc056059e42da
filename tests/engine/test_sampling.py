"""Sampler: the distribution and draws must be exactly those of transformers' generate()."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engine.errors import InvalidRequestError
from engine.sampling import Sampler, SamplingConfig, argmax, argmaxes, build_logits_processors

VOCAB = 64
PROMPT = torch.tensor([[1, 5, 9, 5, 17]])


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=None,  # never stop early: every run has max_new_tokens steps
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def _generate(model: LlamaForCausalLM, seed: int, **kwargs):
    torch.manual_seed(seed)
    return model.generate(
        PROMPT,
        attention_mask=torch.ones_like(PROMPT),
        max_new_tokens=8,
        output_scores=True,  # the processed scores generate() samples from
        output_logits=True,  # the raw logits
        return_dict_in_generate=True,
        **kwargs,
    )


def _random_logits(seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=generator) * 3  # [V]


SAMPLING_CASES = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=0.3, top_k=20, top_p=0.8, repetition_penalty=1.3),
    SamplingConfig(temperature=1.5, top_p=0.5),
    SamplingConfig(temperature=1.0, top_k=5, repetition_penalty=0.8),
    SamplingConfig(temperature=0.9, top_p=0.95, min_p=0.1),
]


@pytest.mark.parametrize("config", SAMPLING_CASES, ids=str)
def test_probs_equal_what_generate_samples_from(tiny_model, config):
    out = _generate(
        tiny_model,
        seed=123,
        do_sample=True,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        min_p=config.min_p or None,
        repetition_penalty=config.repetition_penalty,
    )
    sampler = Sampler(config)
    for step, (logits, scores) in enumerate(zip(out.logits, out.scores, strict=True)):
        history = out.sequences[0, : PROMPT.shape[1] + step]
        expected = torch.softmax(scores[0], dim=-1)
        torch.testing.assert_close(sampler.probs(logits[0], history), expected, rtol=0, atol=1e-7)


def test_draws_replay_generate_under_the_same_global_seed(tiny_model):
    config = SamplingConfig(temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.1)
    out = _generate(
        tiny_model, seed=7, do_sample=True, temperature=0.9, top_k=30, top_p=0.95, repetition_penalty=1.1
    )
    sampler = Sampler(config)  # no seed: draws from torch's global generator, as generate() does
    torch.manual_seed(7)
    for step, logits in enumerate(out.logits):
        history = out.sequences[0, : PROMPT.shape[1] + step]
        assert sampler.sample(logits[0], history) == int(out.sequences[0, PROMPT.shape[1] + step])


def test_greedy_matches_generate_without_sampling(tiny_model):
    out = _generate(tiny_model, seed=0, do_sample=False, repetition_penalty=1.5)
    sampler = Sampler(SamplingConfig(greedy=True, repetition_penalty=1.5))
    for step, logits in enumerate(out.logits):
        history = out.sequences[0, : PROMPT.shape[1] + step]
        assert sampler.sample(logits[0], history) == int(out.sequences[0, PROMPT.shape[1] + step])


def test_processor_order_is_transformers_order():
    config = SamplingConfig(temperature=0.5, top_k=3, top_p=0.9, repetition_penalty=1.2)
    names = [type(p).__name__ for p in build_logits_processors(config)]
    assert names == [
        "RepetitionPenaltyLogitsProcessor",
        "TemperatureLogitsWarper",
        "TopKLogitsWarper",
        "TopPLogitsWarper",
    ]
    assert build_logits_processors(SamplingConfig(temperature=1.0)) == []


@pytest.mark.parametrize("config", [SamplingConfig(temperature=0.0), SamplingConfig(greedy=True)], ids=str)
def test_greedy_is_argmax(config):
    logits = _random_logits()
    history = torch.tensor([], dtype=torch.long)
    sampler = Sampler(config)
    assert config.is_greedy
    assert sampler.sample(logits, history) == int(logits.argmax())
    probs = sampler.probs(logits, history)
    assert probs.dtype == torch.float32
    assert probs[int(logits.argmax())] == 1.0
    assert probs.sum() == 1.0


def test_greedy_takes_the_scores_a_subclass_masks():
    """A sampler that masks the scores (the grammar's, engine.constraints) is greedy over what it
    leaves: the plain logits' argmax is only taken where nothing changes them."""

    class OnlyToken7(Sampler):
        def _scores(self, logits, history):
            scores = super()._scores(logits, history)
            return torch.full_like(scores, float("-inf")).index_fill_(1, torch.tensor([7]), 0.0)

    logits = _random_logits()
    assert int(logits.argmax()) != 7
    assert OnlyToken7(SamplingConfig(greedy=True)).sample(logits, torch.tensor([], dtype=torch.long)) == 7


def test_top_k_one_is_greedy():
    logits = _random_logits(seed=3)
    sampler = Sampler(SamplingConfig(temperature=1.3, top_k=1, seed=0))
    history = torch.tensor([1, 2])
    draws = {sampler.sample(logits, history) for _ in range(50)}
    assert draws == {int(logits.argmax())}


def test_top_p_keeps_the_minimal_nucleus():
    probs_in = torch.tensor([0.5, 0.25, 0.15, 0.06, 0.04])
    sampler = Sampler(SamplingConfig(temperature=1.0, top_p=0.8))
    probs = sampler.probs(probs_in.log(), torch.tensor([], dtype=torch.long))
    # 0.5 + 0.25 = 0.75 < 0.8, so the third token is needed; the fourth is not.
    assert (probs > 0).tolist() == [True, True, True, False, False]
    torch.testing.assert_close(probs[:3], probs_in[:3] / probs_in[:3].sum())


def test_repetition_penalty_lowers_seen_tokens():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    history = torch.tensor([0, 1, 0])
    plain = Sampler(SamplingConfig(temperature=1.0)).probs(logits, history)
    penalised = Sampler(SamplingConfig(temperature=1.0, repetition_penalty=2.0)).probs(logits, history)
    expected_logits = torch.tensor([1.0, -2.0, 0.5, 1.0])  # positive / 2, negative * 2
    torch.testing.assert_close(penalised, torch.softmax(expected_logits, dim=-1))
    assert penalised[0] < plain[0] and penalised[1] < plain[1]
    assert penalised[2] > plain[2] and penalised[3] > plain[3]


def test_openai_penalties_count_the_replys_tokens_only():
    # OpenAI: mu[j] - c[j] * frequency_penalty - (c[j] > 0) * presence_penalty, c over the reply
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0, 0.0])
    history = torch.tensor([3, 3, 0, 2, 2, 4])  # a prompt of two tokens, then the reply 0, 2, 2, 4
    config = SamplingConfig(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    penalised = Sampler(config, prompt_tokens=2).probs(logits, history)
    counts = torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0])  # token 3 is the prompt's: not counted
    expected = logits - 0.25 * counts - 0.5 * (counts > 0).float()
    torch.testing.assert_close(penalised, torch.softmax(expected, dim=-1))
    assert Sampler(config, prompt_tokens=6).probs(logits, history).equal(torch.softmax(logits, dim=-1))


def test_logit_bias_moves_the_greedy_choice_and_bans_a_token():
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    history = torch.tensor([0])
    assert Sampler(SamplingConfig(temperature=0, logit_bias=((1, 100.0),))).sample(logits, history) == 1
    banned = Sampler(SamplingConfig(temperature=1.0, logit_bias=((0, -100.0), (2, 1.5)))).probs(
        logits, history
    )
    torch.testing.assert_close(banned, torch.softmax(torch.tensor([-98.0, -1.0, 2.0, 1.0]), dim=-1))


def test_accepts_half_precision_logits():
    logits = _random_logits(seed=5).to(torch.bfloat16)
    probs = Sampler(SamplingConfig(temperature=0.8, top_p=0.9)).probs(logits, torch.tensor([3]))
    assert probs.dtype == torch.float32 and probs.shape == (VOCAB,)
    torch.testing.assert_close(probs.sum(), torch.tensor(1.0))


def test_seeded_draws_are_reproducible():
    logits = _random_logits(seed=1)
    history = torch.tensor([4, 5])
    config = SamplingConfig(temperature=1.0, seed=1234)
    run_a = Sampler(config)
    run_b = Sampler(config)
    draws_a = [run_a.sample(logits, history) for _ in range(200)]
    draws_b = [run_b.sample(logits, history) for _ in range(200)]
    assert draws_a == draws_b
    assert len(set(draws_a)) > 1


def test_empirical_frequencies_match_probs():
    logits = _random_logits(seed=2, vocab=12) / 3
    history = torch.tensor([0, 3])
    sampler = Sampler(SamplingConfig(temperature=0.9, top_k=8, top_p=0.95, repetition_penalty=1.2, seed=99))
    probs = sampler.probs(logits, history)
    draws = torch.tensor([sampler.sample(logits, history) for _ in range(20_000)])
    frequencies = torch.bincount(draws, minlength=probs.numel()).float() / draws.numel()
    assert (frequencies - probs).abs().max() < 0.02
    assert frequencies[probs == 0].sum() == 0  # filtered tokens are never drawn


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"seed": "x"}, "seed"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.1}, "frequency_penalty"),
        ({"frequency_penalty": float("inf")}, "frequency_penalty"),
        ({"logit_bias": ((3, 101.0),)}, "logit_bias"),
        ({"logit_bias": ((-1, 5.0),)}, "logit_bias"),
    ],
)
def test_invalid_values_name_the_option(kwargs, option):
    config = SamplingConfig(**kwargs)
    with pytest.raises(InvalidRequestError, match=option):
        config.validate()
    with pytest.raises(InvalidRequestError, match=option):
        Sampler(config)


def test_the_argmax_is_torchs_first_largest_on_every_path():
    """numpy's argmax on float32 CPU scores, torch's elsewhere: the first of tied maxima, a NaN
    before anything, as `torch.argmax` gives them."""
    scores = torch.tensor([0.5, 2.0, -1.0, 2.0])
    for values in (scores, scores.half(), scores.bfloat16(), torch.tensor([1.0, float("nan"), 3.0])):
        assert argmax(values) == int(values.argmax())
    big = torch.randn(151_936, generator=torch.Generator().manual_seed(0))
    assert argmax(big) == int(big.argmax())


def test_greedy_reads_a_buffer_rewritten_step_after_step_as_it_is_now():
    """A decode step's logits are one buffer rewritten each step (engine.decode.one_token): the
    sampler keeps its numpy view, and each draw takes the argmax of what the buffer holds then —
    of another tensor, or one numpy cannot read, that tensor's own."""
    sampler, history = Sampler(SamplingConfig(greedy=True)), torch.tensor([], dtype=torch.long)
    buffer = torch.zeros(50)
    for token in (3, 41, 41, 0, 17):
        buffer.zero_()[token] = 1.0
        assert sampler.sample(buffer, history) == token
    other = torch.zeros(50).index_fill_(0, torch.tensor([9]), 1.0)
    assert sampler.sample(other, history) == 9 and sampler.sample(buffer, history) == 17
    assert sampler.sample(other.bfloat16(), history) == 9


def test_a_greedy_verifications_scores_take_the_argmax_each_row_would():
    """Verification's greedy rows: the logits themselves for a plain sampler; with a processor,
    each row's scores after its own context — their argmaxes the one-hot rows' `probs` gave."""
    generator = torch.Generator().manual_seed(3)
    logits, context = torch.randn(4, 50, generator=generator), torch.tensor([3, 7, 7, 9, 11, 5])
    assert Sampler(SamplingConfig(temperature=0.0)).greedy_scores(logits, context, 3) is logits
    sampler = Sampler(SamplingConfig(temperature=0.0, repetition_penalty=5.0))
    scores = sampler.greedy_scores(logits, context, 3)
    wanted = [int(sampler.probs(logits[i], context[: 3 + i]).argmax()) for i in range(4)]
    assert argmaxes(scores) == wanted == argmaxes(scores.double())
