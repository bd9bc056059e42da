"""EngineClient (Qt) with a real worker process: signals, coalescing, death, restart."""

import os
import signal
import time

import pytest

from app.gui.engine.engine_client import ConnectionState, EngineClient, ReplyText, WorkerCrashed
from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig, SamplingConfig
from engine.worker.protocol import ChatMessage, Error, Finished, Stats

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


def _is_text(event) -> bool:
    return isinstance(event, ReplyText)


def _is_finished(event) -> bool:
    return isinstance(event, Finished)


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
    events, stats = [], []
    client.sig_reply.connect(events.append)
    client.sig_stats.connect(stats.append)
    config = GenerationConfig(max_new_tokens=300, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_reply, timeout=60_000, check_params_cb=_is_finished) as done:
        started = time.perf_counter()
        request_id = client.generate(COW, config)
    elapsed_ms = (time.perf_counter() - started) * 1000
    finished = done.args[0]
    assert finished.request_id == request_id and events[-1] == finished
    texts = events[:-1]
    assert all(_is_text(e) and e.request_id == request_id for e in texts), "text, then one end"
    pieces, emits = [e.text for e in texts], [e.tokens for e in texts]
    assert "".join(pieces) + finished.tail == finished.text
    assert sum(emits) == finished.completion_tokens == 300
    # merged per flush: at most one text event each 50 ms flush (however fast the machine decodes)
    assert len(emits) <= elapsed_ms / 50 + 2 and max(emits) > 1, "token events are merged per flush"
    qtbot.waitUntil(lambda: any(isinstance(s, Stats) for s in stats), timeout=3000)


def test_a_killed_worker_is_reported_within_a_second_and_restart_works(qtbot, client):
    client.start()
    _load(qtbot, client)
    config = GenerationConfig(max_new_tokens=2000, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_reply, timeout=30_000, check_params_cb=_is_text):
        request_id = client.generate(COW, config)
    ends = []
    client.sig_reply.connect(lambda event: None if _is_text(event) else ends.append(event))
    client.sig_worker_died.connect(lambda message: ends.append("died"))
    with qtbot.waitSignal(client.sig_worker_died, timeout=1000) as died:
        os.kill(client.ready.pid, signal.SIGKILL)
        killed = time.perf_counter()
    assert time.perf_counter() - killed < 1.0
    assert "stopped unexpectedly" in died.args[0] and client.state is ConnectionState.DEAD
    assert ends == [WorkerCrashed(request_id, died.args[0]), "died"], "the reply ends first, once"

    ends.clear()
    client.generate(COW)  # while dead: an error, not a hang
    qtbot.waitUntil(lambda: [type(e) for e in ends] == [Error], timeout=2000)
    assert ends[0].kind == "worker_died"

    with qtbot.waitSignal(client.sig_ready, timeout=START_S):
        client.restart()
    _load(qtbot, client)
    with qtbot.waitSignal(client.sig_reply, timeout=60_000, check_params_cb=_is_finished) as done:
        client.generate(COW, GenerationConfig(sampling=SamplingConfig(greedy=True)))
    assert done.args[0].text == "A cow says moo."


def test_cancel_ends_the_reply_as_cancelled(qtbot, client):
    client.start()
    _load(qtbot, client)
    config = GenerationConfig(max_new_tokens=2000, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_reply, timeout=30_000, check_params_cb=_is_text):
        request_id = client.generate(COW, config)
    with qtbot.waitSignal(client.sig_reply, timeout=5000, check_params_cb=_is_finished) as done:
        client.cancel(request_id)
    assert done.args[0].reason == "cancelled" and done.args[0].completion_tokens < 2000


RECOVERY_S = 5.0  # kill -9 mid-reply → the model loaded again in a (warm standby) worker


def test_after_a_kill_mid_reply_the_next_reply_is_possible_within_seconds(qtbot, client):
    client.start()
    _load(qtbot, client)
    qtbot.waitUntil(lambda: client.standby_warm, timeout=START_S)  # spawned after the load, imports done
    config = GenerationConfig(max_new_tokens=2000, ignore_eos=True, sampling=SamplingConfig(greedy=True))
    with qtbot.waitSignal(client.sig_reply, timeout=30_000, check_params_cb=_is_text):
        client.generate(COW, config)
    client.sig_worker_died.connect(lambda message: (client.restart(), client.load_model(None, CPU)))
    crashed_pid = client.ready.pid
    with qtbot.waitSignal(client.sig_loaded, timeout=START_S) as reloaded:  # as the window: restart, load
        os.kill(crashed_pid, signal.SIGKILL)
        killed = time.perf_counter()
    loaded = time.perf_counter() - killed
    assert client.ready.pid != crashed_pid and reloaded.args[1]["model_type"] == "qwen3_moe"
    with qtbot.waitSignal(client.sig_reply, timeout=60_000, check_params_cb=_is_finished) as done:
        client.generate(COW, GenerationConfig(sampling=SamplingConfig(greedy=True)))
    replied = time.perf_counter() - killed
    print(f"\nkill -9 → model loaded again {loaded:.2f} s, → next reply finished {replied:.2f} s")
    assert done.args[0].text == "A cow says moo."
    assert loaded < RECOVERY_S, f"the next reply was possible only {loaded:.1f} s after the crash"
