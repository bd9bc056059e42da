"""A thinking model through the server and the official `openai` client: its reasoning comes back
as `reasoning_content` (whole and streamed), apart from the answer, and `chat_template_kwargs`
(`enable_thinking: false`) and `reasoning_effort` reach the chat template."""

import pytest

from app.session_setup import DEMO_MODEL_ID
from engine.generation_config import GenerationConfig, SamplingConfig
from tests.app.server.conftest import LiveServer
from tests.engine.thinking_model import save_thinking_model

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory):
    folder = save_thinking_model(tmp_path_factory.mktemp("thinking"))
    greedy = GenerationConfig(max_new_tokens=10, sampling=SamplingConfig(greedy=True))
    server = LiveServer(model_dir=str(folder), defaults=greedy)
    yield server
    server.stop()


def test_the_reasoning_is_reasoning_content_whole_and_streamed(thinking):
    client = thinking.client()
    reply = client.chat.completions.create(model=DEMO_MODEL_ID, messages=HI)
    message = reply.choices[0].message
    # the template opens <think> in the prompt and a random model never closes it: all is reasoning
    assert message.reasoning_content and message.content == ""
    chunks = list(client.chat.completions.create(model=DEMO_MODEL_ID, messages=HI, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == message.reasoning_content
    assert "".join(d.content or "" for d in deltas) == ""


def test_enable_thinking_false_gives_an_answer_without_reasoning(thinking):
    client = thinking.client()
    reply = client.chat.completions.create(model=DEMO_MODEL_ID, messages=HI, extra_body=NO_THINKING)
    message = reply.choices[0].message
    assert message.content and getattr(message, "reasoning_content", None) is None
    streamed = client.chat.completions.create(
        model=DEMO_MODEL_ID, messages=HI, stream=True, extra_body=NO_THINKING
    )
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == message.content


def test_reasoning_effort_is_taken_and_a_bad_template_argument_is_a_400(thinking):
    client = thinking.client()
    reply = client.chat.completions.create(model=DEMO_MODEL_ID, messages=HI, reasoning_effort="low")
    assert reply.choices[0].message.reasoning_content  # this template ignores it: thinking as usual
    status, body = thinking.request(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"tokenize": true}}',
    )
    assert status == 400 and "tokenize" in body["error"]["message"]
    status, body = thinking.request(
        "POST",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "Hi"}], "reasoning_effort": "extreme"}',
    )
    assert status == 400 and body["error"]["param"] == "reasoning_effort"
