"""Fault and fuzz tests of the local server (127.0.0.1 only, bounded): every hostile input gets
its 4xx in OpenAI's error format and leaves the server serving — the next normal request is
answered within 5 s; a worker killed mid-stream is replaced without a manual restart."""

import json
import logging
import os
import signal
import socket
import time

import openai
import pytest

from app.server.openai_server import ApiServer
from app.server.schemas import ApiError
from app.session_setup import DEMO_MODEL_ID
from tests.app.server.conftest import COW, LiveServer, assert_openai_error

pytestmark = pytest.mark.slow


def chat(**fields) -> bytes:
    return json.dumps({"model": DEMO_MODEL_ID, "messages": COW, **fields}).encode()


def body(**fields) -> bytes:
    return json.dumps({"model": DEMO_MODEL_ID, **fields}).encode()


# The routes of the other APIs, by the hostile requests' names (the chat route is the default).
ROUTES = {
    "an unknown route": "/v1/nothing",
    "DELETE": "/v1/models",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "ollama chat": "/api/chat",
    "ollama generate": "/api/generate",
}


PAGE = "https://evil.example"  # a web page's origin, as a browser names it

HOSTILE = [
    ("seed past 64 bits", "POST", chat(seed=2**64), {}, 400),
    ("negative seed", "POST", chat(seed=-1), {}, 400),
    ("a lone surrogate", "POST", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', {}, 400),
    (
        "a lone surrogate, streamed",
        "POST",
        b'{"stream": true, "messages": [{"role": "user", "content": "\\ud800"}]}',
        {},
        400,
    ),
    ("another Host", "POST", chat(), {"Host": "evil.example"}, 400),
    ("a web page's text/plain", "POST", chat(), {"Content-Type": "text/plain", "Origin": PAGE}, 415),
    (
        "a web page's form",
        "POST",
        chat(),
        {"Content-Type": "application/x-www-form-urlencoded", "Origin": PAGE},
        415,
    ),
    ("form data", "POST", b"a=b", {"Content-Type": "application/x-www-form-urlencoded"}, 400),
    ("deeply nested JSON", "POST", b"[" * 100_000 + b"]" * 100_000, {}, 400),
    ("truncated JSON", "POST", b'{"messages": [', {}, 400),
    ("not UTF-8", "POST", b'{"messages": "\xff\xfe"}', {}, 400),
    ("a JSON array", "POST", b"[1, 2]", {}, 400),
    ("no messages", "POST", chat(messages=[]), {}, 400),
    ("an unknown role", "POST", chat(messages=[{"role": "robot", "content": "x"}]), {}, 400),
    ("an image part", "POST", chat(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), {}, 400),
    ("n=17", "POST", chat(n=17), {}, 400),
    (
        "NaN temperature",
        "POST",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
        {},
        400,
    ),
    ("a bool for max_tokens", "POST", chat(max_tokens=True), {}, 400),
    ("forced tool", "POST", chat(tool_choice="required"), {}, 400),
    ("a body over 16 MiB", "POST", b"{}", {"Content-Length": str(17 * 2**20)}, 413),
    (
        "a prompt past the context window",
        "POST",
        chat(messages=[{"role": "user", "content": "moo " * 3000}]),
        {},
        400,
    ),
    ("an unknown model", "POST", chat(model="gpt-4o"), {}, 404),
    ("an unknown route", "POST", chat(), {}, 404),
    ("completions: a prompt of objects", "POST", body(prompt=[{"text": "x"}]), {}, 400),
    ("completions: a suffix the model cannot fill", "POST", body(prompt="def f(", suffix=")"), {}, 400),
    ("completions: a token past the vocabulary", "POST", body(prompt=[2**31]), {}, 400),
    ("completions: logprobs=21", "POST", body(prompt="Once", logprobs=21), {}, 400),
    ("completions: truncated JSON", "POST", b'{"prompt": "Once', {}, 400),
    ("completions: streamed, no prompt", "POST", body(stream=True), {}, 400),
    ("responses: input a number", "POST", body(input=5), {}, 400),
    ("responses: previous_response_id", "POST", body(input="hi", previous_response_id="resp_1"), {}, 400),
    ("responses: a web search tool", "POST", body(input="hi", tools=[{"type": "web_search"}]), {}, 400),
    ("ollama chat: messages a string", "POST", body(messages="hi"), {}, 400),
    ("ollama chat: an unknown model", "POST", body(model="llama3", messages=COW), {}, 404),
    ("ollama generate: options a list", "POST", body(prompt="Once", options=[1]), {}, 400),
    ("ollama generate: a custom template", "POST", body(prompt="Once", template="{{ .Prompt }}"), {}, 400),
    ("DELETE", "DELETE", b"", {}, 405),
]


@pytest.mark.parametrize(
    ("name", "method", "body", "headers", "status"), HOSTILE, ids=[h[0] for h in HOSTILE]
)
def test_a_hostile_request_gets_its_4xx_and_the_next_normal_one_succeeds(
    live, name, method, body, headers, status
):
    path = ROUTES.get(name.split(":")[0], "/v1/chat/completions")
    got, reply = live.request(method, path, body, headers)  # a too-large body is refused unread
    assert got == status, reply
    if path.startswith("/api/"):
        assert isinstance(reply["error"], str) and reply["error"], "Ollama's errors are a message"
    elif name != "another Host":  # TrustedHostMiddleware answers in plain text: not an API client
        assert_openai_error(reply)
    started = time.monotonic()
    answer = live.client(timeout=5).chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)
    assert "moo" in answer.choices[0].message.content and time.monotonic() - started < 5


def test_the_context_window_is_an_openai_context_length_error(live):
    with pytest.raises(openai.BadRequestError) as caught:
        live.client().chat.completions.create(
            model=DEMO_MODEL_ID, messages=[{"role": "user", "content": "moo " * 3000}]
        )
    assert caught.value.code == "context_length_exceeded" and "1024" in caught.value.message


def test_query_strings_are_never_logged(live, caplog):
    caplog.set_level(logging.DEBUG)
    status, _ = live.request("GET", "/v1/models?api_key=sk-very-secret")
    assert status == 200
    assert "sk-very-secret" not in caplog.text


def test_health_says_the_engine_is_ready(live):
    status, body = live.request("GET", "/health")
    assert status == 200 and body["status"] == "ok" and body["model"] == DEMO_MODEL_ID


def test_an_api_key_is_required_when_set():
    server = LiveServer(api_key="sk-local")
    try:
        with pytest.raises(openai.AuthenticationError) as caught:
            server.client(api_key="wrong").models.list()
        assert caught.value.code == "invalid_api_key"
        assert [m.id for m in server.client(api_key="sk-local").models.list()] == [DEMO_MODEL_ID]
    finally:
        server.stop()


def test_a_worker_killed_mid_stream_is_replaced_for_the_next_request():
    server = LiveServer(max_new_tokens=400)
    try:
        client = server.client(timeout=120)
        story = [{"role": "user", "content": "Tell me a long story about a cow."}]
        stream = client.chat.completions.create(
            model=DEMO_MODEL_ID, messages=story, temperature=0, stream=True
        )
        next(iter(stream))  # the reply has started
        os.kill(server.session.worker.process.pid, signal.SIGKILL)
        with pytest.raises(openai.APIError):  # the stream ends with the engine's error, not silently
            for _ in stream:
                pass
        answer = client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)
        assert "moo" in answer.choices[0].message.content
        assert server.session.restarts == 1
        status, body = server.request("GET", "/health")
        assert status == 200 and body["restarts"] == 1
    finally:
        server.stop()


def test_a_worker_killed_between_requests_is_noticed_and_replaced():
    server = LiveServer()
    try:
        os.kill(server.session.worker.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 3
        while server.request("GET", "/health")[0] == 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        status, body = server.request("GET", "/health")
        assert status == 503 and body["status"] == "restarting"  # noticed within a second or so
        answer = server.client(timeout=120).chat.completions.create(
            model=DEMO_MODEL_ID, messages=COW, temperature=0
        )
        assert "moo" in answer.choices[0].message.content
        assert server.request("GET", "/health") == (
            200,
            {"status": "ok", "model": DEMO_MODEL_ID, "restarts": 1},
        )
    finally:
        server.stop()


class SlowApi:
    """A stand-in API whose non-streamed completion runs until it is cancelled (or 30 s pass)."""

    def __init__(self):
        self.cancelled_after: float | None = None

    def complete(self, body, cancelled):
        started = time.monotonic()
        if cancelled.wait(30):
            self.cancelled_after = time.monotonic() - started
        raise ApiError(499, "The client closed the request.")


def test_a_client_that_leaves_a_non_streamed_request_cancels_it():
    api = SlowApi()
    server = ApiServer(api, port=0).start()
    try:
        with socket.create_connection(server.address, timeout=10) as sock:
            body = chat()
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            time.sleep(0.5)  # the completion is running
        deadline = time.monotonic() + 5
        while api.cancelled_after is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert api.cancelled_after is not None and api.cancelled_after < 2.0
    finally:
        server.stop()
