"""`POST /v1/completions` through the official `openai` client: a prompt continued as written,
streamed or not, echoed with its logprobs as an evaluation harness asks, several prompts and
choices, and fill-in-the-middle on a tiny model whose tokenizer has Qwen2.5-Coder's FIM tokens."""

import math

import openai
import pytest

from app.session_setup import DEMO_MODEL_ID
from tests.app.server.conftest import LiveServer
from tests.engine.coder_model import save_coder_model

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, a cow"


def complete(live_client, **options):
    return live_client.completions.create(
        model=DEMO_MODEL_ID, **{"prompt": PROMPT, "temperature": 0, **options}
    )


def test_a_prompt_is_continued_as_written_whole_and_streamed(live_client, tokenizer):
    reply = complete(live_client, max_tokens=12)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and choice.text and choice.finish_reason == "length"
    assert reply.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"]), "no chat template"
    assert reply.usage.completion_tokens == 12
    pieces = list(complete(live_client, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in pieces if p.choices) == choice.text
    assert pieces[-1].usage.completion_tokens == 12
    assert complete(live_client).usage.completion_tokens <= 16, "OpenAI's default max_tokens"


def test_echo_with_logprobs_scores_the_prompt_as_a_harness_asks(live_client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    reply = complete(live_client, prompt=ids, max_tokens=1, echo=True, logprobs=1)
    choice, logprobs = reply.choices[0], reply.choices[0].logprobs
    assert choice.text.startswith(tokenizer.decode(ids))
    assert len(logprobs.tokens) == len(ids) + 1 and logprobs.tokens[: len(ids)] == [
        tokenizer.decode([i]) for i in ids
    ]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    assert all(lp <= 0 for lp in logprobs.token_logprobs[1:])
    generated = logprobs.tokens[-1]
    assert max(logprobs.top_logprobs[-1], key=logprobs.top_logprobs[-1].get) == generated, (
        "greedy: the likeliest"
    )
    assert logprobs.text_offset == sorted(logprobs.text_offset) and logprobs.text_offset[0] == 0
    again = complete(live_client, prompt=ids, max_tokens=1, echo=True, logprobs=1)  # the prompt is cached now
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(logprobs.token_logprobs)


def test_each_prompt_has_its_n_choices(live_client):
    reply = complete(live_client, prompt=[PROMPT, "The horse"], n=2, max_tokens=4, temperature=1.0, seed=3)
    assert sorted(c.index for c in reply.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in reply.choices}
    assert texts[0] == complete(live_client, max_tokens=4, temperature=1.0, seed=3).choices[0].text
    assert (
        texts[2]
        == complete(live_client, prompt="The horse", max_tokens=4, temperature=1.0, seed=3).choices[0].text
    )


def test_a_model_without_fill_in_the_middle_tokens_says_so(live_client):
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        complete(live_client, suffix=")")


@pytest.mark.parametrize(
    ("options", "param"),
    [
        ({"logprobs": 21}, "logprobs"),
        ({"prompt": []}, "prompt"),
        ({"best_of": 3}, "best_of"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_parameters_name_themselves(live_client, options, param):
    with pytest.raises(openai.BadRequestError) as caught:
        complete(live_client, **options)
    assert caught.value.body["param"] == param


@pytest.fixture(scope="module")
def coder(tmp_path_factory):
    """The server over a tiny model whose tokenizer has Qwen2.5-Coder's fill-in-the-middle tokens."""
    server = LiveServer(model_dir=str(save_coder_model(tmp_path_factory.mktemp("coder"))))
    yield server
    server.stop()


def test_a_suffix_fills_in_the_middle_in_the_models_format(coder):
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    reply = coder.client().completions.create(
        model=DEMO_MODEL_ID, prompt=prefix, suffix=suffix, max_tokens=6, temperature=0, logprobs=0
    )
    assert reply.usage.prompt_tokens == 3 + len(prefix) + len(suffix), "FIM tokens around the two texts"
    assert reply.choices[0].logprobs.tokens and all(
        not math.isnan(lp) for lp in reply.choices[0].logprobs.token_logprobs
    )
    streamed = coder.client().completions.create(
        model=DEMO_MODEL_ID, prompt=prefix, suffix=suffix, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(p.choices[0].text for p in streamed if p.choices) == reply.choices[0].text
