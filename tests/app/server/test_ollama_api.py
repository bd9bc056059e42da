"""Ollama's API through Ollama's own `ollama` client: over the live demo model (listing, chat and
generate, whole and streamed, JSON mode, tools, errors), and over a stand-in API with canned
OpenAI replies, which shows what a request becomes and how a reply comes back (raw and suffix
prompts through the completions API, calls, thinking, counts, an error in the middle of a stream)."""

import json
from types import SimpleNamespace

import httpx
import ollama
import pytest

from app.server.openai_server import ApiServer
from app.server.schemas import ApiError
from app.session_setup import DEMO_MODEL_ID
from tests.engine.tool_helpers import WEATHER, WEATHER_QUESTION

COW = [{"role": "user", "content": "What sound does a cow make?"}]
GREEDY = {"temperature": 0, "num_predict": 24}


def host(server: ApiServer) -> str:
    address, port = server.address
    return f"http://{address}:{port}"


@pytest.fixture(scope="module")
def client(live):
    with ollama.Client(host=host(live.server), timeout=60) as client:
        yield client


# --- over the live demo model


@pytest.mark.slow
def test_the_model_is_listed_shown_and_running(client, live):
    assert [m.model for m in client.list().models] == [DEMO_MODEL_ID]
    listed = client.list().models[0]
    assert listed.details.family == "qwen3_moe" and listed.details.format == "safetensors"
    assert listed.size > 0 and listed.details.quantization_level, "the loaded model's facts"
    shown = client.show(DEMO_MODEL_ID)
    assert shown.capabilities == ["completion", "tools"] and shown.details.family == "qwen3_moe"
    assert shown.modelinfo["general.architecture"] == "qwen3_moe"
    assert shown.modelinfo["qwen3_moe.expert_count"] == 16 and shown.modelinfo["qwen3_moe.block_count"] == 6
    assert [m.name for m in client.ps().models] == [DEMO_MODEL_ID]
    assert live.request("GET", "/api/version") == (200, {"version": "0.9.0"})
    assert live.request("GET", "/") == (200, "Ollama is running")


@pytest.mark.slow
def test_a_streamed_chat_says_what_the_whole_one_says(client):
    whole = client.chat(DEMO_MODEL_ID, COW, options=GREEDY)
    assert whole.done and whole.done_reason in ("stop", "length") and whole.message.content
    assert whole.eval_count > 0 and whole.prompt_eval_count > 0 and whole.total_duration > 0
    parts = list(client.chat(DEMO_MODEL_ID, COW, options=GREEDY, stream=True))
    assert [p.done for p in parts] == [False] * (len(parts) - 1) + [True]
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].eval_count == whole.eval_count and parts[-1].done_reason == whole.done_reason


@pytest.mark.slow
def test_generate_answers_a_prompt_whole_and_streamed(client):
    whole = client.generate(DEMO_MODEL_ID, "What sound does a cow make?", options=GREEDY)
    assert whole.done and whole.response and whole.context == []
    parts = list(client.generate(DEMO_MODEL_ID, "What sound does a cow make?", options=GREEDY, stream=True))
    assert "".join(p.response for p in parts) == whole.response and parts[-1].done


@pytest.mark.slow
def test_stream_is_ollamas_default(live):
    status, text = live.request(
        "POST", "/api/chat", json.dumps({"model": DEMO_MODEL_ID, "messages": COW}).encode()
    )
    lines = [json.loads(line) for line in text.splitlines()]
    assert status == 200 and len(lines) > 1 and lines[-1]["done"] is True


@pytest.mark.slow
def test_format_json_gives_json(client):
    reply = client.chat(DEMO_MODEL_ID, COW, format="json", options={"temperature": 0})
    assert isinstance(json.loads(reply.message.content), dict)
    schema = {
        "type": "object",
        "properties": {"sound": {"type": "string", "maxLength": 8}},
        "required": ["sound"],
    }
    reply = client.generate(
        DEMO_MODEL_ID, "What sound does a cow make?", format=schema, options={"temperature": 0}
    )
    assert set(json.loads(reply.response)) == {"sound"}


@pytest.mark.slow
def test_tools_and_a_tool_round_trip_are_accepted(client):
    """Ollama has no tool_choice: a call cannot be forced, so only the round trip's shape is checked."""
    reply = client.chat(DEMO_MODEL_ID, WEATHER_QUESTION, tools=[WEATHER], options=GREEDY)
    assert reply.done and reply.message.role == "assistant"
    assert all(isinstance(c.function.arguments, dict) for c in reply.message.tool_calls or ())
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}}
    history = [
        *WEATHER_QUESTION,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "Sunny, 24 °C", "tool_name": "get_weather"},
    ]
    assert client.chat(DEMO_MODEL_ID, history, tools=[WEATHER], options=GREEDY).done


@pytest.mark.slow
def test_raw_generate_continues_the_prompt_as_written(client, live_client):
    """Through the backend's completions API: the same text as `/v1/completions` gives."""
    prompt = "Once upon a time, a cow"
    raw = client.generate(DEMO_MODEL_ID, prompt, raw=True, options={"temperature": 0, "num_predict": 8})
    text = live_client.completions.create(model=DEMO_MODEL_ID, prompt=prompt, temperature=0, max_tokens=8)
    assert raw.response == text.choices[0].text and raw.eval_count == 8 and raw.done_reason == "length"
    assert raw.context is None  # as Ollama: a raw prompt has no context


@pytest.mark.slow
def test_logprobs_come_back_as_ollamas(client):
    whole = client.chat(DEMO_MODEL_ID, COW, logprobs=True, top_logprobs=2, options=GREEDY)
    assert "".join(entry.token for entry in whole.logprobs) == whole.message.content
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token for e in whole.logprobs), (
        "greedy"
    )
    parts = client.chat(DEMO_MODEL_ID, COW, logprobs=True, top_logprobs=2, options=GREEDY, stream=True)
    assert [e.token for part in parts for e in part.logprobs or ()] == [e.token for e in whole.logprobs]


@pytest.mark.slow
def test_empty_requests_load_the_model(client):
    assert client.generate(DEMO_MODEL_ID).done_reason == "load"
    assert client.chat(DEMO_MODEL_ID, []).done_reason == "load"


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_another_model_is_a_404(client, stream):
    with pytest.raises(ollama.ResponseError) as caught:
        reply = client.chat("llama3.2", COW, stream=stream)
        if stream:
            list(reply)
    assert (
        caught.value.status_code == 404
        and caught.value.error == 'model "llama3.2" not found, try pulling it first'
    )
    with pytest.raises(ollama.ResponseError, match=r"model 'llama3\.2' not found"):
        client.show("llama3.2")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"options": {"temperature": "hot"}}, "options.temperature"),
        ({"options": {"num_predict": 1.5}}, "options.num_predict"),
        ({"options": {"top_p": 7}}, "options.top_p"),
        ({"stream": "yes"}, "stream"),
        ({"format": "yaml"}, "format"),
        ({"template": "{{ .Prompt }}"}, "template"),
        ({"images": ["aGk="]}, "images"),
        ({"context": [1, 2, 3]}, "context"),
        ({"raw": True, "logprobs": True}, "logprobs"),
        ({"suffix": "!", "format": "json"}, "format"),
    ],
)
def test_a_bad_field_is_a_400_that_names_it(live, extra, field):
    body = {"model": DEMO_MODEL_ID, "prompt": "Hi", "stream": False, **extra}
    status, reply = live.request("POST", "/api/generate", json.dumps(body).encode())
    assert status == 400 and set(reply) == {"error"} and field in reply["error"]


@pytest.mark.slow
def test_errors_are_ollamas_shape(live, client):
    with pytest.raises(ollama.ResponseError) as caught:
        client.chat(DEMO_MODEL_ID, COW, options={"temperature": "hot"})
    assert caught.value.status_code == 400 and "options.temperature" in caught.value.error
    assert live.request("POST", "/api/chat", b"{")[0] == 400
    status, reply = live.request("POST", "/api/chat", b"{}", headers={"Content-Type": "text/plain"})
    assert status == 415 and set(reply) == {"error"}
    assert live.request("POST", "/api/pull", b"{}")[0] == 404


# --- over a stand-in API: the translation both ways

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
