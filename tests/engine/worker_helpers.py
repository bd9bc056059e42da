"""An in-process worker for tests: `Worker.serve()` on a thread, spoken to over a real pipe."""

from __future__ import annotations

import multiprocessing
import threading
import time

from engine.config import ExpertBudget, OffloadConfig
from engine.worker.loop import Worker
from engine.worker.protocol import Error, Finished, Loaded, LoadModel, Ready, Shutdown, dumps, loads

SLOW_LINK = OffloadConfig(device="cpu", expert_budget=ExpertBudget(experts=24), sim_link_gbps=0.05)


class WorkerHarness:
    def __init__(self):
        self.conn, worker_end = multiprocessing.Pipe()
        self.worker = Worker(worker_end)
        self.thread = threading.Thread(target=self.worker.serve, name="worker-under-test", daemon=True)
        self.thread.start()
        self.ready = self.next_of(Ready)

    def send(self, request) -> None:
        self.conn.send_bytes(dumps(request))

    def send_bytes(self, data: bytes) -> None:
        self.conn.send_bytes(data)

    def next_event(self, timeout_s: float = 60.0):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"no event within {timeout_s} s")
        return loads(self.conn.recv_bytes(), expect="event")

    def next_of(self, kind, request_id: str | None = None, timeout_s: float = 60.0):
        return self.until(
            lambda e: isinstance(e, kind) and (request_id is None or e.request_id == request_id), timeout_s
        )[-1]

    def until(self, done, timeout_s: float = 60.0) -> list:
        """Events up to and including the first for which `done(event)` is true."""
        deadline = time.monotonic() + timeout_s
        events = []
        while True:
            event = self.next_event(max(deadline - time.monotonic(), 0.01))
            events.append(event)
            if done(event):
                return events

    def finish(self, request_id: str, timeout_s: float = 120.0) -> list:
        """Events of a request up to its Finished, Loaded or Error (other requests' are skipped)."""
        return self.until(
            lambda e: e.request_id == request_id and isinstance(e, Finished | Loaded | Error), timeout_s
        )

    def load(self, request_id: str = "load", offload: OffloadConfig = OffloadConfig(device="cpu")) -> Loaded:
        self.send(LoadModel(request_id, None, offload))
        last = self.finish(request_id)[-1]
        assert isinstance(last, Loaded), last
        return last

    def close(self) -> None:
        self.send(Shutdown("bye"))
        deadline = time.monotonic() + 30
        while self.thread.is_alive() and time.monotonic() < deadline:
            # read what the worker still sends, as the real client does: a full pipe would block
            # its telemetry thread mid-send and the shutdown would wait out its grace period
            while self.conn.poll(0.05):
                try:
                    self.conn.recv_bytes()
                except EOFError:
                    break
            self.thread.join(0.05)
        assert not self.thread.is_alive()
        self.conn.close()
