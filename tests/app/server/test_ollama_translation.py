"""Ollama's API over a stand-in API with canned OpenAI replies, through Ollama's own `ollama`
client: what a request becomes and how a reply comes back (raw and suffix prompts through the
completions API, calls, thinking, counts, an error in the middle of a stream, the API key)."""

import json
from types import SimpleNamespace

import httpx
import ollama
import pytest

from app.server.openai_server import ApiServer
from app.server.schemas import ApiError
from tests.app.server.conftest import COW, host
from tests.engine.tool_helpers import WEATHER

USAGE = {"prompt_tokens": 12, "completion_tokens": 5, "prompt_tokens_details": {"cached_tokens": 2}}
STATS = {"tokens_per_s": 50.0, "prefill_tokens_per_s": 100.0}
COUNTS = {  # 5 tokens at 50/s, the 10 prefilled at 100/s
    "prompt_eval_count": 12,
    "prompt_eval_cached_count": 2,
    "prompt_eval_duration": 100_000_000,
    "eval_count": 5,
    "eval_duration": 100_000_000,
    "load_duration": 0,
}
CALL = {
    "id": "call_x",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}
CHAT_REPLY = {
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Rain?",
                "tool_calls": [CALL],
            },
            "finish_reason": "tool_calls",
            "logprobs": None,
        }
    ],
    "usage": USAGE,
    "stats": STATS,
}


def chat_chunk(delta: dict, finish_reason: str | None = None) -> dict:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
    }


def text_chunk(text: str, finish_reason: str | None = None) -> dict:
    return {
        "object": "text_completion",
        "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}],
    }


CHAT_CHUNKS = [
    chat_chunk({"role": "assistant", "content": ""}),
    chat_chunk({"reasoning_content": "Hm."}),
    chat_chunk({"content": "Moo"}),
    chat_chunk({"content": "!"}),
    chat_chunk({"tool_calls": [{"index": 0, **CALL}]}),
    {**chat_chunk({}, "length"), "stats": STATS},
    {"object": "chat.completion.chunk", "choices": [], "usage": USAGE},
]
TEXT_CHUNKS = [
    text_chunk("return"),
    text_chunk(" a"),
    {**text_chunk("", "length"), "stats": STATS},
    {"object": "text_completion", "choices": [], "usage": USAGE},
]


class StandIn:
    """Canned OpenAI replies; `bodies` keeps what the Ollama routes asked for."""

    model_id = "stand-in"
    created = 1_700_000_000
    defaults = SimpleNamespace(max_new_tokens=99)  # the server's reply length

    def __init__(self):
        self.bodies: list[dict] = []
        self.failure: tuple[int, ApiError] | None = None  # a stream raises the error at that chunk

    def models(self):
        return {"object": "list", "data": []}

    def model_info(self):
        return None  # nothing known: Ollama's details stay empty

    def model_card(self, model_id=None):
        return {}

    def health(self):
        return 200, {"status": "ok"}

    def complete(self, body, cancelled=None):
        self.bodies.append(body)
        return CHAT_REPLY

    def stream(self, body):
        return self._chunks(body, CHAT_CHUNKS)

    def completion(self, body, cancelled=None):
        self.bodies.append(body)
        choice = {"index": 0, "text": "return a", "finish_reason": "length", "logprobs": None}
        return {"object": "text_completion", "choices": [choice], "usage": USAGE, "stats": STATS}

    def completion_stream(self, body):
        return self._chunks(body, TEXT_CHUNKS)

    def _chunks(self, body, chunks):
        self.bodies.append(body)
        for n, chunk in enumerate(chunks):
            if self.failure is not None and self.failure[0] == n:
                raise self.failure[1]
            yield chunk


@pytest.fixture
def stand_in():
    api = StandIn()
    server = ApiServer(api, port=0).start()
    try:
        yield api, host(server)
    finally:
        server.stop()


def ndjson(base: str, path: str, body: dict) -> tuple[int, list[dict]]:
    with httpx.Client(base_url=base, timeout=30) as http:
        response = http.post(path, json=body)
    return response.status_code, [json.loads(line) for line in response.text.splitlines()]


def test_a_chat_becomes_a_chat_completion(stand_in):
    api, base = stand_in
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {"function": {"name": "get_time"}}]},
        {"role": "tool", "content": "12:00", "tool_name": "get_time"},
        {"role": "tool", "content": "Sunny"},
    ]
    options = {
        "temperature": 0.5,
        "top_k": 20,
        "repeat_penalty": 1.1,
        "seed": 7,
        "num_predict": -1,
        "num_ctx": 4096,
    }
    body = {"model": "stand-in:latest", "messages": messages, "options": options, "stream": False}
    body |= {"tools": [WEATHER], "format": {"type": "object"}, "think": False, "keep_alive": "5m"}
    assert ndjson(base, "/api/chat", body)[0] == 200
    sent = api.bodies[-1]
    assert sent["messages"][2]["tool_calls"] == [
        {
            "id": "call_2_0",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call_2_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
    ]
    assert [m.get("tool_call_id") for m in sent["messages"][3:]] == ["call_2_1", "call_2_0"]
    assert {k: v for k, v in sent.items() if k != "messages"} == {
        "model": "stand-in",
        "temperature": 0.5,
        "top_k": 20,
        "repetition_penalty": 1.1,
        "seed": 7,  # num_predict -1: no max_tokens, the server's own limit
        "tools": [WEATHER],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "format", "schema": {"type": "object"}},
        },
        "chat_template_kwargs": {"enable_thinking": False},
    }


def test_a_chat_reply_becomes_ollamas_message(stand_in):
    api, base = stand_in
    with ollama.Client(host=base, timeout=30) as client:
        reply = client.chat("stand-in", COW, think="high", options={"seed": -1, "num_predict": 9, "stop": []})
    assert api.bodies[-1] == {
        "model": "stand-in",
        "messages": COW,
        "reasoning_effort": "high",
        "max_tokens": 9,
    }
    assert reply.message.thinking == "Rain?" and reply.message.content == ""
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert reply.done_reason == "stop" and reply.model == "stand-in"
    read = COUNTS.keys() - {"prompt_eval_cached_count"}  # a count this client does not read
    assert {k: reply[k] for k in read} == {k: COUNTS[k] for k in read}


def test_a_streamed_chat_is_a_line_a_chunk_then_the_counts(stand_in):
    api, base = stand_in
    status, lines = ndjson(base, "/api/chat", {"model": "stand-in", "messages": COW})
    assert status == 200 and api.bodies[-1]["stream"] is True
    assert api.bodies[-1]["stream_options"] == {"include_usage": True}
    assert [line["message"] for line in lines] == [
        {"role": "assistant", "content": "", "thinking": "Hm."},
        {"role": "assistant", "content": "Moo"},
        {"role": "assistant", "content": "!"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "assistant", "content": ""},
    ]
    assert [line["done"] for line in lines] == [False] * 4 + [True]
    assert lines[-1]["done_reason"] == "length" and lines[-1].items() >= COUNTS.items()
    assert all(line["created_at"].endswith("Z") and line["model"] == "stand-in" for line in lines)


@pytest.mark.parametrize("extra", [{"raw": True}, {"suffix": "    return result"}])
def test_raw_and_suffix_prompts_go_to_the_completions_api(stand_in, extra):
    api, base = stand_in
    options = {"temperature": 0.2, "stop": ["\n\n"], "min_p": 0.1}
    body = {"model": "stand-in", "prompt": "def gcd(a, b):", "options": options, "stream": False, **extra}
    status, [reply] = ndjson(base, "/api/generate", body)
    sent = {
        "model": "stand-in",
        "prompt": "def gcd(a, b):",
        "temperature": 0.2,
        "stop": ["\n\n"],
        "min_p": 0.1,
    }
    sent |= {"suffix": extra["suffix"]} if "suffix" in extra else {}
    assert status == 200 and api.bodies[-1] == {**sent, "max_tokens": 99}  # the server's length, not 16
    assert reply["response"] == "return a" and reply["done_reason"] == "length" and "context" not in reply
    assert reply.items() >= COUNTS.items()
    status, lines = ndjson(base, "/api/generate", {**body, "stream": True, "options": {"num_predict": 3}})
    assert api.bodies[-1]["max_tokens"] == 3 and api.bodies[-1]["stream_options"] == {"include_usage": True}
    assert [line["response"] for line in lines] == ["return", " a", ""] and lines[-1]["done"]


def test_a_generate_prompt_is_a_chat_with_its_system_message(stand_in):
    api, base = stand_in
    body = {"model": "stand-in", "prompt": "Hi", "system": "Be brief.", "format": "json", "stream": False}
    status, [reply] = ndjson(base, "/api/generate", body)
    assert status == 200 and api.bodies[-1] == {
        "model": "stand-in",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "response_format": {"type": "json_object"},
    }
    assert reply["response"] == "" and reply["thinking"] == "Rain?" and reply["context"] == []


def test_an_error_before_a_stream_has_its_status_and_one_after_is_the_last_line(stand_in):
    api, base = stand_in
    api.failure = (0, ApiError(503, "The engine is busy."))
    assert ndjson(base, "/api/chat", {"model": "stand-in", "messages": COW}) == (
        503,
        [{"error": "The engine is busy."}],
    )
    api.failure = (2, ApiError(503, "The engine stopped."))  # after the thinking's line went out
    status, lines = ndjson(base, "/api/chat", {"model": "stand-in", "messages": COW})
    assert status == 200 and lines == [lines[0], {"error": "The engine stopped."}]
    with (
        ollama.Client(host=base, timeout=30) as client,
        pytest.raises(ollama.ResponseError, match="engine stopped"),
    ):
        list(client.chat("stand-in", COW, stream=True))
    status, lines = ndjson(
        base, "/api/chat", {"model": "stand-in", "messages": [{"role": "robot", "content": "x"}]}
    )
    assert status == 400 and "messages[0].role" in lines[0]["error"]


def test_a_wrong_api_key_is_ollamas_401():
    server = ApiServer(StandIn(), port=0, api_key="sk-ollama").start()
    try:
        with (
            ollama.Client(host=host(server), timeout=30) as client,
            pytest.raises(ollama.ResponseError) as caught,
        ):
            client.ps()
        assert caught.value.status_code == 401 and caught.value.error == "Incorrect API key provided."
        keyed = {"Authorization": "Bearer sk-ollama"}
        with ollama.Client(host=host(server), timeout=30, headers=keyed) as client:
            assert client.ps().models[0].name == "stand-in"
    finally:
        server.stop()
