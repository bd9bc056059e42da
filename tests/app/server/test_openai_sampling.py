"""What clients send beyond the basics, through the official `openai` client against the demo
model decoding speculatively (the server's default): OpenAI's presence and frequency penalties,
logit_bias, logprobs."""

import openai
import pytest

from app.session_setup import DEMO_MODEL_ID
from engine.generation_config import GenerationConfig, SpecConfig
from tests.app.server.conftest import COW, LiveServer

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a long story about a cow."}]


@pytest.fixture(scope="module")
def live():
    defaults = GenerationConfig(max_new_tokens=48, spec=SpecConfig(mode="auto"), prefetch="auto")
    server = LiveServer(defaults=defaults)
    yield server
    server.stop()


def greedy(live_client, messages=STORY, **options) -> str:
    reply = live_client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=messages, temperature=0, **options
    )
    return reply.choices[0].message.content


def test_penalties_change_the_reply_and_zero_changes_nothing(live_client, tokenizer):
    plain = greedy(live_client)
    assert greedy(live_client, presence_penalty=0, frequency_penalty=0) == plain
    for options in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = greedy(live_client, **options)
        assert penalised != plain, options
        # a penalty on what the reply said lowers repeats: the penalised reply repeats less
        words = penalised.split()
        assert len(set(words)) / len(words) >= len(set(plain.split())) / len(plain.split()), options


def test_logit_bias_bans_and_forces_tokens(live_client, tokenizer):
    plain = greedy(live_client, COW)
    assert plain == "A cow says moo."
    moo = tokenizer.encode(" moo", add_special_tokens=False)
    assert len(moo) == 1, "the demo's tokenizer spells ' moo' as one token"
    banned = greedy(live_client, COW, logit_bias={str(moo[0]): -100})
    assert " moo" not in banned and moo[0] not in tokenizer.encode(banned, add_special_tokens=False)
    forced = greedy(live_client, COW, logit_bias={str(moo[0]): 100}, max_tokens=3)
    assert forced == " moo moo moo"


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"12": 101}}, "logit_bias"),
        ({"logit_bias": {"cow": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, None),  # past the vocabulary: the engine says so
    ],
)
def test_out_of_range_values_are_400s_naming_the_parameter(live_client, options, param):
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(live_client, COW, **options)
    assert caught.value.body["param"] == param
    assert "logit_bias" in caught.value.body["message"] or param in caught.value.body["message"]


def test_logprobs_top_token_is_the_greedy_token_whole_and_streamed(live_client, tokenizer):
    reply = live_client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=COW, temperature=0, logprobs=True, top_logprobs=3
    )
    assert reply.choices[0].message.content == "A cow says moo."
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens - 1, "the end-of-reply token is not in the text"
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].token == entry.token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob) and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert bytes(entry.bytes).decode("utf-8") == entry.token
    assert "".join(e.token for e in content) == "A cow says moo."

    chunks = list(
        live_client.chat.completions.create(
            model=DEMO_MODEL_ID, messages=COW, temperature=0, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def test_logprobs_of_a_sampled_reply_are_the_distribution_it_was_drawn_from(live_client):
    reply = live_client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=STORY, temperature=0.8, seed=7, logprobs=True, top_logprobs=5
    )
    content = reply.choices[0].logprobs.content
    assert content and all(e.logprob <= 0 for e in content)
    for entry in content:  # a drawn token lies among the alternatives, or is less likely than the fifth
        tops = {t.token: t.logprob for t in entry.top_logprobs}
        assert tops.get(entry.token, entry.logprob) == pytest.approx(entry.logprob, abs=1e-5)
        assert entry.token in tops or entry.logprob <= min(tops.values()) + 1e-6
    plain = live_client.chat.completions.create(model=DEMO_MODEL_ID, messages=STORY, temperature=0.8, seed=7)
    assert plain.choices[0].message.content == reply.choices[0].message.content, "logprobs change no draw"
    assert plain.choices[0].logprobs is None


def test_top_logprobs_without_logprobs_is_a_400(live_client):
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(live_client, COW, top_logprobs=2)
    assert caught.value.body["param"] == "top_logprobs"
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(live_client, COW, logprobs=True, top_logprobs=21)
    assert caught.value.body["param"] == "top_logprobs"


def test_n_choices_are_generated_one_after_another_each_with_its_seed(live_client):
    def sampled(n: int, seed: int, stream: bool = False):
        options = {"model": DEMO_MODEL_ID, "messages": STORY, "temperature": 1.0, "n": n, "seed": seed}
        if not stream:
            reply = live_client.chat.completions.create(**options)
            return [c.message.content for c in sorted(reply.choices, key=lambda c: c.index)], reply.usage
        texts = ["", ""]
        for piece in live_client.chat.completions.create(**options, stream=True):
            for choice in piece.choices:
                texts[choice.index] += choice.delta.content or ""
        return texts, None

    (first, second), usage = sampled(2, seed=5)
    assert first != second, "each choice draws with its own seed"
    assert [first] == sampled(1, seed=5)[0] and [second] == sampled(1, seed=6)[0], "choice i has seed + i"
    assert sampled(2, seed=5, stream=True)[0] == [first, second]
    single = live_client.chat.completions.create(model=DEMO_MODEL_ID, messages=STORY, temperature=1.0, seed=5)
    assert usage.prompt_tokens == single.usage.prompt_tokens, "the prompt counts once"
    assert usage.completion_tokens > single.usage.completion_tokens
