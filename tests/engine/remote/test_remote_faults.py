"""Network faults from a remote engine are clear `RemoteError`s with a kind, a cut reply keeps its
text (reason "interrupted"), and the worker serves the next request (the retry) as usual."""

import socket
import time

import pytest

from engine.generation_config import GenerationConfig
from engine.remote import RemoteEndpoint, RemoteError, RemoteTimeouts, RemoteWorker, connect, remote_stats
from engine.remote import errors as kinds
from engine.remote.worker import CLOSE_QUIET_AFTER_S
from engine.worker.protocol import Cancel, Error, Finished, Generate, GetStats, Token, Tune
from tests.engine.remote.fake_openai import SILENCE, FakeOpenAI, chunked, full_reply, http, sse_chunk
from tests.engine.remote.helpers import HI, events_until_end, reply


@pytest.fixture
def fake(request):
    server = FakeOpenAI(*request.param)
    yield server
    server.stop()


def _worker(url: str, **timeouts) -> RemoteWorker:
    worker = RemoteWorker(
        RemoteEndpoint("fake", url), api_key="sk-secret", timeouts=RemoteTimeouts(**timeouts)
    )
    worker.start()
    return worker


CUT = chunked(sse_chunk("Hel"), sse_chunk("lo"), end=False)


@pytest.mark.parametrize("fake", [(CUT, full_reply("Hello", " again"))], indirect=True)
def test_a_cut_stream_keeps_the_partial_reply_and_the_retry_works(fake):
    worker = _worker(fake.url)
    try:
        *tokens, end = reply(worker, "r1")
        assert [t.text for t in tokens] == ["Hel", "lo"] and all(isinstance(t, Token) for t in tokens)
        assert isinstance(end, Finished) and end.reason == "interrupted" and end.text == "Hello"
        assert end.stats["error"]["kind"] == kinds.STREAM_CUT and "kept" in end.stats["error"]["message"]
        *_, again = reply(worker, "r2")  # the same worker: the retry is the same request sent again
        assert again.reason == "eos" and again.text == "Hello again"
        assert (
            fake.requests[0]["messages"]
            == fake.requests[1]["messages"]
            == [{"role": "user", "content": "Hi"}]
        )
    finally:
        worker.kill()


@pytest.mark.parametrize(
    ("fake", "kind", "words"),
    [
        (
            (http("401 Unauthorized", '{"error": {"message": "Invalid API key"}}'),),
            kinds.UNAUTHORIZED,
            "API key",
        ),
        ((http("403 Forbidden", '{"detail": "Forbidden"}'),), kinds.UNAUTHORIZED, "HTTP 403"),
        (
            (http("429 Too Many Requests", '{"error": {"message": "slow down"}}', {"Retry-After": "7"}),),
            kinds.RATE_LIMITED,
            "Retry after 7 s",
        ),
        (
            (http("503 Service Unavailable", '{"error": {"message": "overloaded"}}'),),
            kinds.SERVER_ERROR,
            "overloaded",
        ),
        (
            (
                http(
                    "400 Bad Request",
                    '{"error": {"message": "This model\'s maximum context length is 4096 tokens"}}',
                ),
            ),
            kinds.CONTEXT_LENGTH,
            "context window",
        ),
        (
            (http("400 Bad Request", '{"error": {"message": "temperature out of range"}}'),),
            kinds.BAD_REQUEST,
            "temperature out of range",
        ),
        ((http("200 OK", "not json at all"),), kinds.PROTOCOL, "not the OpenAI API"),
    ],
    indirect=["fake"],
)
def test_http_failures_are_errors_of_a_kind_without_the_key(fake, kind, words):
    worker = _worker(fake.url)
    try:
        (error,) = reply(worker, "r1")
        assert isinstance(error, Error) and error.kind == kind, error
        assert words in error.message and "sk-secret" not in error.message
    finally:
        worker.kill()


@pytest.mark.parametrize("fake", [(SILENCE,)], indirect=True)
def test_a_silent_server_times_out(fake):
    worker = _worker(fake.url, read_s=0.5)
    try:
        (error,) = reply(worker, "r1")
        assert error.kind == kinds.TIMEOUT and kinds.TIMEOUT in kinds.RETRYABLE
    finally:
        worker.kill()


@pytest.mark.parametrize("fake", [(SILENCE, full_reply("Back"))], indirect=True)
def test_cancel_does_not_wait_for_a_silent_server(fake):
    worker = _worker(fake.url)
    try:
        worker.send(Generate("g1", HI))
        time.sleep(0.2)
        cancelled_at = time.monotonic()
        worker.send(Cancel("c1", "g1"))
        (end,) = events_until_end(worker, "g1", timeout_s=10)
        assert end.reason == "cancelled" and end.text == ""
        assert time.monotonic() - cancelled_at < CLOSE_QUIET_AFTER_S + 1.5
        *_, again = reply(worker, "g2")  # the worker goes on
        assert again.text == "Back"
    finally:
        worker.kill()


def test_a_refused_connection_and_a_tls_mismatch_fail_at_connect():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(RemoteError) as refused:
        connect(f"http://127.0.0.1:{port}", timeouts=RemoteTimeouts(connect_s=2))
    assert refused.value.kind == kinds.UNREACHABLE and refused.value.retryable
    fake = FakeOpenAI(full_reply("x"))
    try:
        with pytest.raises(RemoteError) as tls:  # https to a plain-HTTP server
            connect(
                fake.url.replace("http://", "https://"), timeouts=RemoteTimeouts(connect_s=2, request_s=5)
            )
        assert tls.value.kind == kinds.TLS and "certificate" in str(tls.value)
    finally:
        fake.stop()


@pytest.mark.parametrize("fake", [(full_reply("a"),)], indirect=True)
def test_the_request_carries_the_generation_settings(fake):
    worker = _worker(fake.url)
    config = GenerationConfig(
        max_new_tokens=7, stop_strings=("END",), template_kwargs={"enable_thinking": False}
    )
    try:
        reply(worker, "r1", config)
    finally:
        worker.kill()
    (sent,) = fake.requests
    assert sent["model"] == "fake-moe" and sent["stream"] is True and sent["max_tokens"] == 7
    assert sent["stop"] == ["END"] and sent["chat_template_kwargs"] == {"enable_thinking": False}
    assert sent["stream_options"] == {"include_usage": True}


def test_a_closed_worker_says_so():
    fake = FakeOpenAI(full_reply("a"))
    try:
        worker = _worker(fake.url)
        worker.kill()
        assert not worker.alive
        with pytest.raises(Exception, match="closed"):
            worker.poll(0.1)
    finally:
        fake.stop()


@pytest.mark.parametrize("fake", [(full_reply("a"),)], indirect=True)
def test_auto_tune_is_refused_and_stats_answer_at_once(fake):
    worker = _worker(fake.url)
    try:
        worker.send(Tune("t1"))
        (refused,) = events_until_end(worker, "t1")
        assert refused.kind == kinds.UNSUPPORTED and "local engine" in refused.message
        worker.send(GetStats("s1"))
        stats = worker.poll(5)
        while stats.request_id != "s1":
            stats = worker.poll(5)
        record = remote_stats(stats)
        assert record.base_url == fake.url and record.ttft_ms is None and stats.vram_used_bytes is None
    finally:
        worker.kill()
