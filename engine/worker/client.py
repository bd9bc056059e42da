"""Client side of the worker protocol, without Qt and without torch.

`WorkerProcess` starts the worker with the `spawn` context and moves protocol
messages over its pipe; `EngineSession` adds blocking, one-request-at-a-time
calls (load, generate as an iterator, cancel) for the terminal chat and the
local server. The GUI's `app.gui.engine_client.EngineClient` wraps `WorkerProcess`
in a QObject instead.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from collections.abc import Callable, Iterator

from engine.config import OffloadConfig
from engine.errors import EngineError
from engine.generation_config import GenerationConfig
from engine.worker.entry import run_worker
from engine.worker.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    ChatMessage,
    Error,
    Event,
    Finished,
    Generate,
    GetStats,
    Loaded,
    LoadModel,
    LoadProgress,
    Notice,
    ProtocolError,
    ProtocolVersionError,
    Ready,
    Request,
    Shutdown,
    Stats,
    Token,
    dumps,
    loads,
)

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120.0  # the worker imports torch and transformers before it is Ready


class WorkerDied(EngineError):
    kind = "worker_died"


class RequestFailed(EngineError):
    """The worker answered a request with an `Error` event."""

    def __init__(self, error: Error):
        super().__init__(error.message)
        self.kind = error.kind
        self.error = error


class WorkerProcess:
    """One worker process and the pipe to it."""

    def __init__(self, log_level: int = logging.WARNING):
        self.log_level = log_level
        self.process: multiprocessing.process.BaseProcess | None = None
        self.conn: multiprocessing.connection.Connection | None = None
        self.ready: Ready | None = None
        self._send_lock = threading.Lock()

    def start(self, timeout_s: float = START_TIMEOUT_S) -> Ready:
        """Start the worker and wait for its `Ready`; a version mismatch raises `ProtocolVersionError`."""
        context = multiprocessing.get_context("spawn")
        self.conn, child_end = context.Pipe(duplex=True)
        self.process = context.Process(
            target=run_worker, args=(child_end, self.log_level), name="moe-chat-worker", daemon=True
        )
        self.process.start()
        child_end.close()  # only the worker holds it now: its death closes the pipe
        deadline = time.monotonic() + timeout_s
        while (event := self.poll(max(deadline - time.monotonic(), 0))) is not None:
            if isinstance(event, Ready):
                if event.protocol_version != PROTOCOL_VERSION:
                    self.kill()
                    raise ProtocolVersionError(
                        f"The engine speaks protocol version {event.protocol_version}, this app "
                        f"{PROTOCOL_VERSION}. Reinstall MoE Chat so both match."
                    )
                self.ready = event
                return event
            if isinstance(event, Error):
                self.kill()
                raise RequestFailed(event)
        self.kill()
        raise WorkerDied(f"The engine process did not start within {timeout_s:.0f} s.")

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()

    def send(self, request: Request) -> None:
        if self.conn is None:
            raise WorkerDied("The engine process is not running.")
        try:
            with self._send_lock:
                self.conn.send_bytes(dumps(request))
        except (BrokenPipeError, EOFError, OSError) as err:
            raise WorkerDied(self._death_message()) from err

    def send_raw(self, data: bytes) -> None:
        """Send any bytes (tests of the worker's handling of malformed messages)."""
        with self._send_lock:
            self.conn.send_bytes(data)

    def poll(self, timeout_s: float | None = None) -> Event | None:
        """The next event, or None after `timeout_s`; raises `WorkerDied` when the worker is gone."""
        if self.conn is None or self.process is None:
            raise WorkerDied("The engine process is not running.")
        ready = multiprocessing.connection.wait([self.conn, self.process.sentinel], timeout_s)
        if self.conn in ready:
            try:
                data = self.conn.recv_bytes()
            except (EOFError, OSError) as err:
                raise WorkerDied(self._death_message()) from err
            try:
                return loads(data, expect="event")
            except ProtocolVersionError:
                raise
            except ProtocolError as err:
                return Error("", err.kind, f"The engine sent a message this app cannot read: {err}")
        if ready:  # only the sentinel: the process ended with nothing left to read
            raise WorkerDied(self._death_message())
        return None

    def _death_message(self) -> str:
        if self.process is not None:
            self.process.join(0.5)
        code = self.process.exitcode if self.process is not None else None
        how = (
            f"exit code {code}"
            if code is not None and code >= 0
            else f"signal {-code}"
            if code
            else "unknown"
        )
        return f"The engine process stopped unexpectedly ({how})."

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to shut down; kill it if it does not within `timeout_s`."""
        if self.process is None:
            return
        if self.process.is_alive():
            with contextlib.suppress(WorkerDied):
                self.send(Shutdown("shutdown"))
            self.process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        if self.conn is not None:
            self.conn.close()
        self.conn = None


class EngineSession:
    """Blocking calls over a `WorkerProcess`, one request at a time (terminal chat, local server)."""

    def __init__(self, worker: WorkerProcess | None = None):
        self.worker = worker or WorkerProcess()
        self.model: dict | None = None
        self.last_stats: Stats | None = None
        self.notices: list[str] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one request at a time

    def start(self) -> Ready:
        return self.worker.start()

    def next_id(self) -> str:
        return f"r{next(self._ids)}"

    def load(
        self,
        model_dir: str | None = None,
        offload: OffloadConfig = OffloadConfig(),
        on_progress: Callable[[LoadProgress], None] | None = None,
    ) -> Loaded:
        with self._lock:
            request_id = self.next_id()
            self.worker.send(LoadModel(request_id, model_dir, offload))
            for event in self._events(request_id):
                if isinstance(event, LoadProgress) and on_progress is not None:
                    on_progress(event)
                elif isinstance(event, Loaded):
                    self.model = event.model
                    return event
        raise AssertionError("unreachable: _events ends with Loaded, Finished or an exception")

    def generate(
        self, messages: list[ChatMessage], config: GenerationConfig = GenerationConfig()
    ) -> Iterator[Token | Finished]:
        """Stream the reply: Token events, then one Finished. Closing the iterator early cancels."""
        with self._lock:
            request_id = self.next_id()
            finished = False
            try:
                self.worker.send(Generate(request_id, tuple(messages), config))
                for event in self._events(request_id):
                    if isinstance(event, Token | Finished):
                        finished = isinstance(event, Finished)
                        yield event
            finally:
                if not finished and self.worker.alive:
                    self._cancel_and_drain(request_id)

    def _cancel_and_drain(self, request_id: str) -> None:
        self.worker.send(Cancel(self.next_id(), request_id))
        with contextlib.suppress(RequestFailed):
            for _ in self._events(request_id):
                pass

    def cancel(self, request_id: str) -> None:
        self.worker.send(Cancel(self.next_id(), request_id))

    def stats(self, timeout_s: float = 5.0) -> Stats:
        """Fresh telemetry (only between requests: during one, see `last_stats`)."""
        with self._lock:
            request_id = self.next_id()
            self.worker.send(GetStats(request_id))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                event = self.worker.poll(deadline - time.monotonic())
                if isinstance(event, Stats):
                    self.last_stats = event
                    if event.request_id == request_id:
                        return event
        raise WorkerDied("The engine did not answer within 5 s.")

    def _events(self, request_id: str) -> Iterator[Event]:
        """Events of `request_id` until its last (Loaded, Finished; Error raises); keeps Stats."""
        while True:
            event = self.worker.poll(None)
            if isinstance(event, Stats):
                self.last_stats = event
                continue
            if isinstance(event, Notice):
                self.notices.append(event.message)
                log.warning("%s", event.message)
            if event is None or event.request_id != request_id:
                continue
            if isinstance(event, Error):
                raise RequestFailed(event)
            yield event
            if isinstance(event, Loaded | Finished):
                return

    def close(self) -> None:
        self.worker.stop()
