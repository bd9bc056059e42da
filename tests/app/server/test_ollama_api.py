"""Ollama's API through Ollama's own `ollama` client over the live demo model: listing, chat and
generate, whole and streamed, JSON mode, tools, errors. What a request becomes and how a reply
comes back is tests/app/server/test_ollama_translation.py."""

import json

import ollama
import pytest

from app.session_setup import DEMO_MODEL_ID
from tests.app.server.conftest import COW, host
from tests.engine.tool_helpers import WEATHER, WEATHER_QUESTION

GREEDY = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def client(live):
    with ollama.Client(host=host(live.server), timeout=60) as client:
        yield client


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
def test_ollamas_curl_example_streams_by_default(live):
    # `curl http://localhost:11434/api/chat -d '{…}'`: curl says form data, the body is JSON
    body = json.dumps({"model": DEMO_MODEL_ID, "messages": COW}).encode()
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    status, text = live.request("POST", "/api/chat", body, headers=form)
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
    from_a_page = {"Content-Type": "text/plain", "Origin": "https://evil.example"}
    status, reply = live.request("POST", "/api/chat", b"{}", headers=from_a_page)
    assert status == 415 and set(reply) == {"error"}
    assert live.request("POST", "/api/pull", b"{}")[0] == 404
