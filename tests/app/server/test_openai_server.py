"""The local OpenAI-compatible server, spoken to with the official `openai` client.

One server on a free port, in a thread, over one real worker with the demo model
(starting a worker costs seconds, so the module shares it). Raw HTTP checks what
the client hides: malformed JSON, unknown routes, a client that hangs up.
"""

import http.client
import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from app.server.openai_api import ChatBackend
from app.server.openai_server import ApiServer, HostNotAllowed, main
from app.session_setup import DEMO_MODEL_ID
from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig
from engine.worker.client import EngineSession

COW = [{"role": "user", "content": "What sound does a cow make?"}]


@pytest.fixture(scope="module")
def server():
    session = EngineSession()
    session.start()
    try:
        session.load(offload=OffloadConfig(device="cpu"))
        backend = ChatBackend(session, DEMO_MODEL_ID, GenerationConfig(max_new_tokens=64))
        server = ApiServer(backend, port=0).start()
        yield server
        server.stop()
        backend.close()
    finally:
        session.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def cow_reply(client):
    return client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)


def post_raw(server: ApiServer, path: str, body: bytes, method: str = "POST") -> tuple[int, dict]:
    host, port = server.address
    conn = http.client.HTTPConnection(host, port, timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def assert_openai_error(body: dict) -> dict:
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.slow
def test_models_lists_the_loaded_model(client):
    assert [m.id for m in client.models.list()] == [DEMO_MODEL_ID]
    assert client.models.retrieve(DEMO_MODEL_ID).id == DEMO_MODEL_ID


@pytest.mark.slow
def test_a_chat_completion_answers_with_usage(cow_reply):
    choice = cow_reply.choices[0]
    assert "moo" in choice.message.content
    assert choice.message.role == "assistant" and choice.finish_reason == "stop"
    assert cow_reply.model == DEMO_MODEL_ID and cow_reply.object == "chat.completion"
    usage = cow_reply.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.slow
def test_streamed_chunks_make_the_same_reply(client, cow_reply):
    chunks = list(
        client.chat.completions.create(
            model=DEMO_MODEL_ID,
            messages=COW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    *with_choices, usage_chunk = chunks
    assert with_choices[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in with_choices)
    assert text == cow_reply.choices[0].message.content
    assert [c.choices[0].finish_reason for c in with_choices][-2:] == [None, "stop"]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == cow_reply.usage.total_tokens
    # the same question again: the kept KV cache held all of its prompt but the last token
    cached = usage_chunk.usage.prompt_tokens_details.cached_tokens
    assert cached == usage_chunk.usage.prompt_tokens - 1


@pytest.mark.slow
def test_max_tokens_and_stop(client):
    short = client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0, max_tokens=2)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == 2
    stopped = client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0, stop="moo")
    assert stopped.choices[0].finish_reason == "stop"
    assert "moo" not in stopped.choices[0].message.content


@pytest.mark.slow
def test_concurrent_requests_wait_their_turn(client):
    def ask(_):
        return client.chat.completions.create(model=DEMO_MODEL_ID, messages=COW, temperature=0)

    with ThreadPoolExecutor(2) as pool:
        replies = list(pool.map(ask, range(2)))
    assert all("moo" in r.choices[0].message.content for r in replies)


@pytest.mark.slow
def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-4o", messages=COW)
    assert caught.value.code == "model_not_found"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("options", "param"),
    [({"n": 17}, "n"), ({"temperature": 3}, "temperature"), ({"messages": []}, "messages")],
)
def test_bad_parameters_are_bad_requests(client, options, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**{"model": DEMO_MODEL_ID, "messages": COW, **options})
    assert caught.value.body["param"] == param


@pytest.mark.slow
def test_malformed_json_is_a_400_in_openai_format(server):
    status, body = post_raw(server, "/v1/chat/completions", b'{"model": "moe-chat-demo", "messages": [')
    assert status == 400
    assert assert_openai_error(body)["type"] == "invalid_request_error"


@pytest.mark.slow
def test_an_unknown_route_is_a_404_in_openai_format(server):
    status, body = post_raw(server, "/v1/nothing", b"{}")
    assert status == 404
    assert_openai_error(body)


class EndlessApi:
    """A stand-in API whose stream never ends; it records when it is closed."""

    def __init__(self):
        self.closed = threading.Event()

    def complete(self, body, cancelled=None):
        raise AssertionError("the test streams")

    def stream(self, body):
        try:
            while True:
                time.sleep(0.001)
                yield {"object": "chat.completion.chunk", "choices": [{"delta": {"content": "moo "}}]}
        finally:
            self.closed.set()


def test_a_client_that_hangs_up_closes_its_stream(caplog):
    api = EndlessApi()
    server = ApiServer(api, port=0).start()
    try:
        body = json.dumps({"stream": True}).encode()
        with socket.create_connection(server.address, timeout=10) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                + b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            received = b""
            while b"data: " not in received:  # the headers may come in a packet of their own
                data = sock.recv(4096)
                assert data, f"the server closed the stream after {received!r}"
                received += data
        assert api.closed.wait(10), "the stream went on after the client hung up"
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR], "a hang-up is not an error"
    finally:
        server.stop()


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.10", "example.com"])
def test_only_this_computer_may_connect(host, capsys):
    with pytest.raises(HostNotAllowed, match=r"127\.0\.0\.1"):
        ApiServer(EndlessApi(), port=0, host=host)
    assert main(["--host", host]) == 2  # refused before the engine starts
    assert "only listens on 127.0.0.1" in capsys.readouterr().err
