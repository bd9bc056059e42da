"""EngineClient (Qt) with a real worker process: signals, coalescing, death, restart."""

import os
import signal
import time

import pytest

from app.gui.engine_client import ConnectionState, EngineClient
from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.worker.protocol import ChatMessage, Finished, Stats

pytestmark = [pytest.mark.gui, pytest.mark.slow]

COW = [ChatMessage("user", "What sound does a cow make?")]
CPU = OffloadConfig(device="cpu")
START_S = 90_000  # ms: the worker imports torch before it is ready


@pytest.fixture
def client(qtbot):
    engine = EngineClient()
    yield engine
    engine.shutdown()


def _load(qtbot, client) -> None:
    with qtbot.waitSignal(client.sig_loaded, timeout=START_S):
        client.load_model(None, CPU)


def test_requests_made_while_starting_are_sent_once_ready(qtbot, client):
    with qtbot.waitSignal(client.sig_ready, timeout=START_S) as ready:
        client.start()
        assert client.state is ConnectionState.STARTING
        load_id = client.load_model(None, CPU)  # queued until the worker is ready
    assert ready.args[0].protocol_version >= 1 and client.state is ConnectionState.READY
    with qtbot.waitSignal(client.sig_loaded, timeout=START_S) as loaded:
        pass
    assert loaded.args[0] == load_id and loaded.args[1]["model_type"] == "qwen3_moe"


def test_a_reply_streams_coalesced_and_ends_with_finished(qtbot, client):
    client.start()
    _load(qtbot, client)
    pieces, emits, stats = [], [], []
    client.sig_tokens.connect(lambda rid, text, n: (pieces.append(text), emits.append(n)))
    client.sig_stats.connect(stats.append)
    config = GenerationConfig(max_new_tokens=300, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_finished, timeout=60_000) as done:
        request_id = client.generate(COW, config)
    rid, finished = done.args
    assert rid == request_id and isinstance(finished, Finished)
    assert "".join(pieces) + finished.tail == finished.text
    assert sum(emits) == finished.completion_tokens == 300
    assert len(emits) < 300 / 3, "token events are merged per flush, not emitted one by one"
    qtbot.waitUntil(lambda: any(isinstance(s, Stats) for s in stats), timeout=3000)


def test_a_killed_worker_is_reported_within_a_second_and_restart_works(qtbot, client):
    client.start()
    _load(qtbot, client)
    config = GenerationConfig(max_new_tokens=2000, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_tokens, timeout=30_000):
        client.generate(COW, config)
    with qtbot.waitSignal(client.sig_worker_died, timeout=1000) as died:
        os.kill(client.ready.pid, signal.SIGKILL)
        killed = time.perf_counter()
    assert time.perf_counter() - killed < 1.0
    assert "stopped unexpectedly" in died.args[0] and client.state is ConnectionState.DEAD

    errors = []
    client.sig_error.connect(lambda rid, kind, message: errors.append(kind))
    client.generate(COW)  # while dead: an error, not a hang
    qtbot.waitUntil(lambda: errors == ["worker_died"], timeout=2000)

    with qtbot.waitSignal(client.sig_ready, timeout=START_S):
        client.restart()
    _load(qtbot, client)
    with qtbot.waitSignal(client.sig_finished, timeout=60_000) as done:
        client.generate(COW, GenerationConfig(sampling=SamplingConfig(greedy=True)))
    assert done.args[1].text == "A cow says moo."


def test_cancel_ends_the_reply_as_cancelled(qtbot, client):
    client.start()
    _load(qtbot, client)
    config = GenerationConfig(max_new_tokens=2000, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_tokens, timeout=30_000):
        request_id = client.generate(COW, config)
    with qtbot.waitSignal(client.sig_finished, timeout=5000) as done:
        client.cancel(request_id)
    assert done.args[1].reason == "cancelled" and done.args[1].completion_tokens < 2000
