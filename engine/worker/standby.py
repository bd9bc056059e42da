"""A worker process started ahead of need, so a crash or a restart does not wait for imports.

Client side, torch-free. `StandbyWorker` spawns the worker at once in standby: it imports
the engine and the model's transformers module (`engine.worker.warm_up`), says so
(`warm`), and waits. `start()` wakes it; it then starts serving like any worker
(`Ready`, device probed only now), so it is a drop-in `WorkerProcess`. A standby that
is never woken ends with its client's `kill()` or, with the client gone, at EOF.
"""

from __future__ import annotations

import logging
import multiprocessing
import time

from engine.worker.client import START_TIMEOUT_S, WorkerDied, WorkerProcess
from engine.worker.entry import WAKE, WARM, run_worker
from engine.worker.protocol import Ready

log = logging.getLogger(__name__)


class StandbyWorker(WorkerProcess):
    """A `WorkerProcess` whose process starts now and serves once `start()` wakes it."""

    def __init__(self, warm_model: str | None = None, log_level: int = logging.WARNING):
        super().__init__(log_level)
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe(duplex=True)
        self.process = context.Process(
            target=run_worker,
            args=(child_end, log_level, True, warm_model),
            name="moe-chat-standby",
            daemon=True,
        )
        self.process.start()
        child_end.close()
        self.warm_model = warm_model
        self._warm = False

    @property
    def warm(self) -> bool:
        """True once its imports are done (non-blocking)."""
        if not self._warm and self.alive and self.conn.poll(0):
            try:
                self._warm = self.conn.recv_bytes() == WARM
            except (EOFError, OSError):
                return False
        return self._warm and self.alive

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Ready:
        """Wake it and wait for its `Ready` (seconds at most when it is warm already)."""
        deadline = time.monotonic() + timeout_s
        while not self.warm:
            if not self.alive or time.monotonic() > deadline:
                self.kill()
                raise WorkerDied("The standby engine process did not start.")
            self.conn.poll(min(0.1, max(deadline - time.monotonic(), 0)))
        try:
            self.conn.send_bytes(WAKE)
        except (BrokenPipeError, EOFError, OSError) as err:
            raise WorkerDied(self._death_message()) from err
        event = self.poll(max(deadline - time.monotonic(), 0))
        if isinstance(event, Ready):
            self.ready = event
            return event
        self.kill()
        raise WorkerDied(f"The standby engine process did not answer its wake-up ({event!r}).")
