"""What clients send beyond the basics, through the official `openai` client against the demo
model: OpenAI's presence and frequency penalties, logit_bias."""

import openai
import pytest
from transformers import AutoTokenizer

from app.session_setup import DEMO_MODEL_ID
from engine.resources import demo_model_dir
from tests.app.server.conftest import COW, LiveServer

pytestmark = pytest.mark.slow

STORY = [{"role": "user", "content": "Tell me a long story about a cow."}]


@pytest.fixture(scope="module")
def live():
    server = LiveServer(max_new_tokens=48)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(live):
    return live.client()


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(demo_model_dir())


def greedy(client, messages=STORY, **options) -> str:
    reply = client.chat.completions.create(model=DEMO_MODEL_ID, messages=messages, temperature=0, **options)
    return reply.choices[0].message.content


def test_penalties_change_the_reply_and_zero_changes_nothing(client, tokenizer):
    plain = greedy(client)
    assert greedy(client, presence_penalty=0, frequency_penalty=0) == plain
    for options in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = greedy(client, **options)
        assert penalised != plain, options
        # a penalty on what the reply said lowers repeats: the penalised reply repeats less
        words = penalised.split()
        assert len(set(words)) / len(words) >= len(set(plain.split())) / len(plain.split()), options


def test_logit_bias_bans_and_forces_tokens(client, tokenizer):
    plain = greedy(client, COW)
    assert plain == "A cow says moo."
    moo = tokenizer.encode(" moo", add_special_tokens=False)
    assert len(moo) == 1, "the demo's tokenizer spells ' moo' as one token"
    banned = greedy(client, COW, logit_bias={str(moo[0]): -100})
    assert " moo" not in banned and moo[0] not in tokenizer.encode(banned, add_special_tokens=False)
    forced = greedy(client, COW, logit_bias={str(moo[0]): 100}, max_tokens=3)
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
def test_out_of_range_values_are_400s_naming_the_parameter(client, options, param):
    with pytest.raises(openai.BadRequestError) as caught:
        greedy(client, COW, **options)
    assert caught.value.body["param"] == param
    assert "logit_bias" in caught.value.body["message"] or param in caught.value.body["message"]
