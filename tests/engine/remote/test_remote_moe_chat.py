"""A remote engine that is MoE Chat's own server (`moe-chat-cli serve`'s `ApiServer`) on 127.0.0.1:
over a tiny thinking model (models, a streamed reply, `reasoning_content` from its template, a
wrong key, an unknown model, logprobs) and over a scripted engine (cancel mid-stream, a tool call round
trip, reasoning apart from the answer)."""

import threading
import time
from dataclasses import replace

import pytest

from app.server.openai_api import ChatBackend
from app.server.openai_server import ApiServer
from app.session_setup import DEMO_MODEL_ID
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.remote import RemoteEndpoint, RemoteError, RemoteWorker, connect, remote_stats
from engine.remote import errors as kinds
from engine.worker.client import RequestFailed
from engine.worker.protocol import Cancel, ChatMessage, Finished, Generate, LoadModel, Token
from tests.app.server.conftest import LiveServer
from tests.engine.remote.helpers import HI, events_until_end, reply
from tests.engine.thinking_model import save_thinking_model

KEY = "sk-moe-chat-test"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The server over a tiny thinking model (its template opens <think>), asking for a key."""
    folder = save_thinking_model(tmp_path_factory.mktemp("thinking"))
    greedy = GenerationConfig(max_new_tokens=8, sampling=SamplingConfig(greedy=True))
    server = LiveServer(api_key=KEY, model_dir=str(folder), defaults=greedy)
    yield server
    server.stop()


# greedy: sampled, a random model may open <think> itself and make the reply reasoning
NO_THINKING = GenerationConfig(
    max_new_tokens=8, sampling=SamplingConfig(greedy=True), template_kwargs={"enable_thinking": False}
)


def test_models_a_streamed_reply_and_its_stats(live):
    session = connect(live.url, api_key=KEY)
    try:
        assert session.model["model_id"] == DEMO_MODEL_ID and session.model["models"] == [DEMO_MODEL_ID]
        *tokens, end = session.generate([ChatMessage("user", "What sound does a cow make?")], NO_THINKING)
        assert all(isinstance(t, Token) for t in tokens) and isinstance(end, Finished)
        assert end.text == "".join(t.text for t in tokens) and end.text and end.reasoning == ""
        assert end.reason in ("eos", "length") and end.completion_tokens >= len(tokens) > 0
        assert end.prompt_tokens > 0 and end.stats["tokens_counted_by"] == "usage"
        assert end.stats["ttft_ms"] > 0
        record = remote_stats(session.stats())
        assert record.model == DEMO_MODEL_ID and record.ttft_ms == end.stats["ttft_ms"]
        assert record.metrics.kv_cache_usage is None and "no /metrics" in record.metrics.error
    finally:
        session.close()


def test_logprobs_come_back_from_the_remote(live):
    session = connect(live.url, api_key=KEY)
    try:
        config = replace(NO_THINKING, logprobs=3)
        *tokens, end = session.generate([ChatMessage("user", "What sound does a cow make?")], config)
        entries = [entry for token in tokens for entry in token.logprobs]
        assert entries and all(len(entry.top) == 3 and entry.top[0][0] == entry.token for entry in entries)
        assert "".join(entry.token for entry in entries).endswith(end.text), "every token, in order"
    finally:
        session.close()


def test_a_thinking_templates_reasoning_content(live):
    session = connect(live.url, api_key=KEY)
    try:
        *tokens, end = session.generate(list(HI), GenerationConfig(max_new_tokens=8))
        # the template opens <think> and a random model never closes it: all of it is reasoning
        assert end.reasoning and end.text == "" and "".join(t.reasoning for t in tokens) == end.reasoning
    finally:
        session.close()


def test_a_wrong_key_is_a_401_and_an_unknown_model_is_named(live):
    with pytest.raises(RemoteError) as refused:
        connect(live.url, api_key="sk-wrong")
    assert refused.value.kind == kinds.UNAUTHORIZED and refused.value.status == 401
    assert "sk-wrong" not in str(refused.value) and KEY not in str(refused.value)
    with pytest.raises(RequestFailed) as unknown:
        connect(live.url, api_key=KEY, model="no-such-model")
    assert unknown.value.kind == kinds.MODEL_NOT_FOUND and DEMO_MODEL_ID in str(unknown.value)


class ScriptedEngine:
    """Stands in for `EngineSession` behind the real server: each `generate` streams the next
    scripted reply, `delay_s` per piece; `closed` counts the replies the server stopped early."""

    alive = True

    def restart(self) -> None:
        pass

    def __init__(self, *replies: tuple[str, str], delay_s: float = 0.0):
        self.replies, self.delay_s, self.asked, self.closed = list(replies), delay_s, [], 0
        self.restarts, self.lock = 0, threading.Lock()

    def generate(self, messages, config, completion=None):
        self.asked.append((list(messages), config))
        reasoning, text = self.replies.pop(0)
        pieces = [(r, "") for r in reasoning.split(" ") if r] + [
            ("", text[i : i + 5]) for i in range(0, len(text), 5)
        ]
        finished = False
        try:
            for n, (think, answer) in enumerate(pieces):
                time.sleep(self.delay_s)
                yield Token("r", answer, n, n, 1.0, think)
            finished = True
            yield Finished("r", "eos", text, "", 3, len(pieces), {}, reasoning.replace(" ", ""))
        finally:
            self.closed += not finished


@pytest.fixture
def scripted(request):
    engine = ScriptedEngine(*request.param["replies"], delay_s=request.param.get("delay_s", 0.0))
    backend = ChatBackend(engine, DEMO_MODEL_ID, GenerationConfig())
    server = ApiServer(backend, port=0).start()
    worker = RemoteWorker(RemoteEndpoint("scripted", server.url))
    worker.start()
    yield engine, worker
    worker.kill()
    server.stop()
    backend.close()


LONG = ("", "word " * 200)


@pytest.mark.parametrize("scripted", [{"replies": [LONG], "delay_s": 0.02}], indirect=True)
def test_cancel_mid_stream_ends_the_reply_and_the_servers_generation(scripted):
    engine, worker = scripted
    worker.send(Generate("g1", HI))
    first = worker.poll(30)
    while not isinstance(first, Token):
        first = worker.poll(30)
    worker.send(Cancel("c1", "g1"))
    *tokens, end = events_until_end(worker, "g1", timeout_s=10)
    assert end.reason == "cancelled" and end.text == first.text + "".join(t.text for t in tokens)
    assert len(end.text) < len(LONG[1])
    deadline = time.monotonic() + 10
    while engine.closed == 0 and time.monotonic() < deadline:  # the server saw the client leave
        time.sleep(0.05)
    assert engine.closed == 1


@pytest.mark.parametrize(
    "scripted", [{"replies": [("", CALL), ("", "It is 18 °C in Paris.")]}], indirect=True
)
def test_a_tool_call_round_trip(scripted):
    engine, worker = scripted
    worker.send(LoadModel("l1", DEMO_MODEL_ID))
    events_until_end(worker, "l1")
    question = ChatMessage("user", "Weather in Paris?")
    *_, called = reply(worker, "g1", GenerationConfig(tools=(WEATHER,)), (question,))
    assert called.reason == "tool_calls" and called.text == ""
    (call,) = called.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}} and call["id"]
    history = (
        question,
        ChatMessage("assistant", "", called.tool_calls),
        ChatMessage("tool", "18 °C", tool_call_id=call["id"]),
    )
    *_, answer = reply(worker, "g2", GenerationConfig(tools=(WEATHER,)), history)
    assert answer.reason == "eos" and answer.text == "It is 18 °C in Paris."
    asked, config = engine.asked[1]
    assert asked[1].tool_calls[0]["function"]["arguments"] == {"city": "Paris"}
    assert asked[2] == ChatMessage("tool", "18 °C", tool_call_id=call["id"])
    assert config.tools[0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("scripted", [{"replies": [("Let me think.", "Moo.")]}], indirect=True)
def test_reasoning_comes_apart_from_the_answer(scripted):
    _, worker = scripted
    *tokens, end = reply(worker, "g1")
    assert "".join(t.reasoning for t in tokens) == end.reasoning == "Letmethink."
    assert "".join(t.text for t in tokens) == end.text == "Moo."


@pytest.mark.parametrize("scripted", [{"replies": [("", "Moo.")]}], indirect=True)
def test_openais_penalties_and_logit_bias_reach_the_remote_engine(scripted):
    engine, worker = scripted
    sampling = SamplingConfig(
        temperature=0.5, presence_penalty=0.5, frequency_penalty=-1.0, logit_bias=((7, -100.0),)
    )
    *_, answer = reply(worker, "g1", GenerationConfig(sampling=sampling))
    assert answer.text == "Moo."
    asked = engine.asked[0][1].sampling
    assert (asked.presence_penalty, asked.frequency_penalty, asked.logit_bias) == (0.5, -1.0, ((7, -100.0),))
