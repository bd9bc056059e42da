"""The OpenAI API's request checks and error mapping, over a stand-in session (no worker)."""

import openai
import pytest

from app.server.openai_api import ApiError, ChatBackend, parse_chat_request
from app.server.openai_server import ApiServer
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.worker.client import RequestFailed, WorkerDied
from engine.worker.protocol import ChatMessage, Error, Finished, Token

MODEL = "moe-chat-demo"
DEFAULTS = GenerationConfig(max_new_tokens=99, sampling=SamplingConfig(temperature=0.5, greedy=True))
COW = [{"role": "user", "content": "What sound does a cow make?"}]


def parse(**body):
    return parse_chat_request({"model": MODEL, "messages": COW, **body}, MODEL, DEFAULTS)


def test_what_a_request_leaves_out_comes_from_the_defaults():
    request = parse()
    assert request.config == DEFAULTS and request.stream is False and request.include_usage is False
    assert request.messages == (ChatMessage("user", "What sound does a cow make?"),)


def test_request_options_override_the_defaults():
    request = parse(
        max_completion_tokens=7,
        temperature=0.9,
        top_p=0.5,
        seed=3,
        stop=["a", "b"],
        stream=True,
        stream_options={"include_usage": True},
    )
    sampling = request.config.sampling
    assert request.config.max_new_tokens == 7 and request.config.stop_strings == ("a", "b")
    assert (sampling.temperature, sampling.top_p, sampling.seed, sampling.greedy) == (0.9, 0.5, 3, False)
    assert request.stream and request.include_usage
    assert parse(max_tokens=5, stop="x").config.stop_strings == ("x",)
    assert parse(temperature=0).config.sampling.is_greedy


def test_developer_messages_and_text_parts():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]},
    ]
    request = parse(messages=messages)
    assert request.messages == (ChatMessage("system", "Be brief."), ChatMessage("user", "Hello"))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 17}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "9"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"seed": 1.5}, "seed"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"messages": [{"role": "assistant", "content": None}]}, "messages[0].content"),
        ({"logprobs": "yes"}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
    ],
)
def test_bad_requests_name_the_parameter(body, param):
    with pytest.raises(ApiError) as caught:
        parse(**body)
    assert caught.value.status == 400 and caught.value.param == param


def test_harmless_defaults_of_unsupported_features_pass():
    parse(logprobs=False, tool_choice="none", response_format={"type": "text"}, presence_penalty=0)


def test_another_model_is_not_found():
    with pytest.raises(ApiError) as caught:
        parse(model="gpt-4o")
    assert (caught.value.status, caught.value.code) == (404, "model_not_found")


class ScriptedSession:
    """Stands in for `EngineSession.generate`: yields the script's events, raises its exceptions."""

    def __init__(self, *script):
        self.script = script
        self.alive = True
        self.restarts = 0

    def restart(self) -> None:
        pass

    def generate(self, messages, config, completion=None):
        for step in self.script:
            if isinstance(step, BaseException):
                raise step
            yield step


FINISHED = Finished("r1", "eos", "moo", "", 5, 1, {})


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (WorkerDied("The engine process stopped unexpectedly (signal 9)."), 503),
        (RequestFailed(Error("r1", "invalid_request", "max_new_tokens too large")), 400),
        (RequestFailed(Error("r1", "internal", "Internal error: boom")), 500),
    ],
)
def test_engine_errors_have_their_http_status(error, status):
    backend = ChatBackend(ScriptedSession(error), MODEL, DEFAULTS)
    with pytest.raises(ApiError) as caught:
        backend.complete({"model": MODEL, "messages": COW})
    assert caught.value.status == status
    with pytest.raises(ApiError) as caught:
        next(backend.stream({"model": MODEL, "messages": COW, "stream": True}))
    assert caught.value.status == status


@pytest.fixture
def serve():
    servers, clients = [], []

    def start(session) -> openai.OpenAI:
        server = ApiServer(ChatBackend(session, MODEL, DEFAULTS), port=0).start()
        servers.append(server)
        clients.append(openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=10))
        return clients[-1]

    yield start
    for client in clients:
        client.close()
    for server in servers:
        server.stop()


def test_a_dead_engine_is_503(serve):
    client = serve(ScriptedSession(WorkerDied("The engine process stopped unexpectedly.")))
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(model=MODEL, messages=COW)
    assert caught.value.status_code == 503 and caught.value.code == "engine_unavailable"


def test_an_error_mid_stream_reaches_the_client(serve):
    failure = RequestFailed(Error("r1", "internal", "Internal error: boom"))
    client = serve(ScriptedSession(Token("r1", "A", 1, 0, 1.0), failure))
    stream = client.chat.completions.create(model=MODEL, messages=COW, stream=True)
    with pytest.raises(openai.APIError, match="boom"):
        list(stream)


def test_the_tail_is_sent_before_the_finish(serve):
    finished = Finished("r1", "length", "A cow", " cow", 5, 2, {})
    client = serve(ScriptedSession(Token("r1", "A", 1, 0, 1.0), finished))
    chunks = list(client.chat.completions.create(model=MODEL, messages=COW, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "A cow"
    assert chunks[-1].choices[0].finish_reason == "length"
