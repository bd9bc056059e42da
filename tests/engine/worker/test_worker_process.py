"""A real worker process (spawn): end to end, killed mid-reply, orphaned by its parent."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from engine.config import OffloadConfig
from engine.generation_config import GenerationConfig, SamplingConfig, SpecConfig
from engine.worker.client import EngineSession, WorkerDied, WorkerProcess
from engine.worker.protocol import Cancel, ChatMessage, Error, Finished, Generate, GetStats, Stats, Token

pytestmark = pytest.mark.slow

COW = [ChatMessage("user", "What sound does a cow make?")]
LONG = GenerationConfig(max_new_tokens=2000, ignore_eos=True, sampling=SamplingConfig(greedy=True))


def test_end_to_end_load_generate_cancel_and_shut_down():
    session = EngineSession()
    ready = session.start()
    try:
        assert ready.pid == session.worker.process.pid != os.getpid()
        loaded = session.load(offload=OffloadConfig(device="cpu"))
        assert loaded.model["model_type"] == "qwen3_moe"
        events = list(session.generate(COW, GenerationConfig(sampling=SamplingConfig(greedy=True))))
        assert events[-1].text == "A cow says moo." and events[-1].reason == "eos"

        worker = session.worker
        worker.send(Generate("long", tuple(COW), LONG))
        while not isinstance(event := worker.poll(30), Token):
            assert not isinstance(event, Error), event
        asked = time.perf_counter()
        worker.send(Cancel("c", "long"))
        while not isinstance(event := worker.poll(30), Finished):
            pass
        latency_ms = (time.perf_counter() - asked) * 1e3
        print(f"cancel latency {latency_ms:.1f} ms after {event.completion_tokens} tokens")
        assert event.reason == "cancelled" and latency_ms < 1000
    finally:
        session.close()
    assert session.worker.process.exitcode == 0


def test_malformed_bytes_from_a_client_do_not_stop_the_worker():
    worker = WorkerProcess()
    worker.start()
    try:
        worker.send_raw(b"garbage")
        worker.send(GetStats("s"))
        events = [worker.poll(10), worker.poll(10)]
        kinds = [type(e) for e in events]
        assert Error in kinds and Stats in kinds
    finally:
        worker.stop()


def test_a_killed_worker_is_noticed_within_a_second_and_a_new_one_starts():
    worker = WorkerProcess()
    worker.start()
    try:
        session = EngineSession(worker)
        session.load(offload=OffloadConfig(device="cpu"))
        worker.send(Generate("long", tuple(COW), LONG))
        while not isinstance(worker.poll(30), Token):
            pass
        os.kill(worker.process.pid, signal.SIGKILL)
        killed = time.perf_counter()
        with pytest.raises(WorkerDied, match="stopped unexpectedly"):
            while True:
                worker.poll(2)
        assert time.perf_counter() - killed < 1.0
    finally:
        worker.kill()
    restarted = EngineSession()
    restarted.start()
    try:
        restarted.load(offload=OffloadConfig(device="cpu"))
        assert list(restarted.generate(COW))[-1].completion_tokens > 0
    finally:
        restarted.close()


PARENT = textwrap.dedent(
    """
    import sys, time
    from engine.worker.client import WorkerProcess

    if __name__ == "__main__":
        worker = WorkerProcess()
        worker.start()
        print(worker.process.pid, flush=True)
        time.sleep(600)
    """
)


def test_the_worker_exits_when_its_parent_dies(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        worker_pid = int(parent.stdout.readline())
        assert psutil.pid_exists(worker_pid)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while psutil.pid_exists(worker_pid) and time.monotonic() < deadline:
            try:
                if psutil.Process(worker_pid).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            if psutil.pid_exists(worker_pid):
                os.kill(worker_pid, signal.SIGKILL)
                pytest.fail("the orphaned worker did not exit within 10 s")
    finally:
        parent.kill()
        parent.stdout.close()
        parent.wait(10)


def test_a_reply_that_loads_the_draft_model_prints_no_progress_bar(capfd):
    """transformers' "Loading weights" bar (tqdm, on the worker's stderr) would garble the
    terminal chat's live output when the first reply loads the draft model."""
    session = EngineSession()
    session.start()
    try:
        session.load(offload=OffloadConfig(device="cpu"))
        capfd.readouterr()  # what the start and the load printed
        config = GenerationConfig(
            max_new_tokens=8,
            sampling=SamplingConfig(greedy=True),
            spec=SpecConfig(mode="auto"),
            prefetch="auto",
        )
        finished = list(session.generate(COW, config))[-1]
        assert finished.stats["spec"] == "draft", "the demo drafts with its bundled draft model"
    finally:
        session.close()
    err = capfd.readouterr().err
    assert "Loading weights" not in err and "it/s]" not in err, err
