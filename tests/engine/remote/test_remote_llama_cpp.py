"""llama.cpp's server (`python -m llama_cpp.server`, the extra `llama-server`) as a third-party remote
engine on 127.0.0.1, over a tiny GGUF written here: models, a streamed reply, cancel mid-stream, a 401
with a wrong key, and no /metrics (every field None). Skipped where llama-cpp-python is not installed."""

import socket
import subprocess
import sys
import time
import urllib.request
from importlib.util import find_spec

import pytest

from engine.generation_config import GenerationConfig
from engine.remote import RemoteEndpoint, RemoteError, RemoteWorker, connect, remote_stats
from engine.remote import errors as kinds
from engine.worker.protocol import Cancel, Finished, Generate, Token
from tests.engine.remote.helpers import HI, events_until_end

# looked up, not imported: the server runs in its own process, and loading llama.cpp here costs time
if find_spec("llama_cpp") is None or find_spec("starlette_context") is None:
    pytest.skip('needs llama.cpp\'s server: pip install -e ".[llama-server]"', allow_module_level=True)
pytestmark = pytest.mark.slow

KEY = "sk-llama-test"
START_TIMEOUT_S = 120


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_until_up(url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    request = urllib.request.Request(f"{url}/models", headers={"Authorization": f"Bearer {KEY}"})
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(f"llama.cpp's server exited with status {process.returncode}")
        try:
            with urllib.request.urlopen(request, timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise AssertionError(f"llama.cpp's server did not answer within {START_TIMEOUT_S} s")


@pytest.fixture(scope="module")
def gguf(tmp_path_factory) -> str:
    from engine.tiny.gguf_writer import write_tiny_gguf

    return str(write_tiny_gguf(tmp_path_factory.mktemp("gguf"), "qwen3_moe"))


@pytest.fixture
def llama(gguf):
    """llama.cpp's server on the tiny GGUF, one per test: llama-cpp-python 0.3.36's server (with the
    starlette here) stops answering for good once a client leaves in the middle of a stream, so a
    test that cancels must not leave it to the next."""
    port = _free_port()
    command = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--host", "127.0.0.1"]
    command += ["--port", str(port), "--n_ctx", "1024", "--n_threads", "1", "--api_key", KEY]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    try:
        _wait_until_up(url, process)
        yield url, gguf
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def test_models_a_streamed_reply_and_a_wrong_key(llama):
    url, gguf = llama
    with pytest.raises(RemoteError) as refused:
        connect(url, api_key="sk-wrong")
    assert refused.value.kind == kinds.UNAUTHORIZED and refused.value.status == 401
    session = connect(url, api_key=KEY)
    try:
        assert session.model["model_id"] == gguf and session.model["models"] == [gguf]
        *tokens, end = session.generate(list(HI), GenerationConfig(max_new_tokens=12))
        assert tokens and all(isinstance(t, Token) for t in tokens) and isinstance(end, Finished)
        assert end.reason in ("length", "eos") and end.text == "".join(t.text for t in tokens)
        assert end.stats["ttft_ms"] > 0
        record = remote_stats(session.stats())
        assert record.model == gguf and record.metrics.kv_cache_usage is None and record.metrics.error
    finally:
        session.close()


def test_cancel_mid_stream(llama):
    url, _ = llama
    worker = RemoteWorker(RemoteEndpoint("llama.cpp", url), KEY)
    worker.start()
    try:
        worker.send(Generate("g1", HI, GenerationConfig(max_new_tokens=900)))
        first = worker.poll(60)
        while not isinstance(first, Token):
            first = worker.poll(60)
        worker.send(Cancel("c1", "g1"))
        cancelled_at = time.monotonic()
        *_, end = events_until_end(worker, "g1", timeout_s=30)
        assert end.reason == "cancelled" and end.completion_tokens < 900
        assert time.monotonic() - cancelled_at < 5  # at the next chunk
    finally:
        worker.kill()
