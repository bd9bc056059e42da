"""Client side of the worker protocol, without Qt and without torch.

`WorkerProcess` starts the worker with the `spawn` context and moves protocol
messages over its pipe; `EngineSession` adds blocking, one-request-at-a-time
calls (load, generate as an iterator, cancel) for the terminal chat and the
local server. The GUI's `app.gui.engine.engine_client.EngineClient` wraps `WorkerProcess`
in a QObject instead.

No wait is unbounded: a request waits at most `QUEUE_TIMEOUT_S` for its turn, and a
running request at most `STALL_TIMEOUT_S` (generation; `LOAD_STALL_TIMEOUT_S` for a
load) between two events from the worker, which sends Stats at 4 Hz while it works.
A worker that goes silent that long is killed. A request that fails, in the worker or
before it was sent, releases the session at once; a session whose worker died starts a
new one and loads the same model again before its next request (`ensure_worker`).
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
from engine.errors import EngineError, InvalidRequestError
from engine.generation_config import CompletionPrompt, GenerationConfig
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
STALL_TIMEOUT_S = 120.0  # a generation sends Stats at 4 Hz: this long without any event is a wedged worker
LOAD_STALL_TIMEOUT_S = 900.0  # a load reports progress per layer; converting a large store takes a while
QUEUE_TIMEOUT_S = 600.0  # how long a request waits for the one before it
CANCEL_TIMEOUT_S = 30.0  # a cancelled request ends at the next step; a worker slower than this is killed


class WorkerDied(EngineError):
    kind = "worker_died"


class EngineBusy(EngineError):
    """The request waited `QUEUE_TIMEOUT_S` for the ones before it."""

    kind = "engine_busy"


class RequestFailed(EngineError):
    """The worker answered a request with an `Error` event."""

    def __init__(self, error: Error):
        super().__init__(error.message)
        self.kind = error.kind
        self.error = error


def encode_request(request: Request) -> bytes:
    """The request's bytes on the pipe; text JSON cannot carry (a lone surrogate) is the request's fault."""
    try:
        return dumps(request)
    except (ValueError, TypeError) as err:
        raise InvalidRequestError(f"The request cannot be sent to the engine: {err}") from err


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
        data = encode_request(request)
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
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
        self.restarts = 0  # workers started again after one died
        self._loaded_with: tuple[str | None, OffloadConfig] | None = None  # what `ensure_worker` reloads
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # one request at a time

    def start(self) -> Ready:
        return self.worker.start()

    def next_id(self) -> str:
        return f"r{next(self._ids)}"

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """This request's turn with the engine, waited for at most `QUEUE_TIMEOUT_S`."""
        if not self._lock.acquire(timeout=QUEUE_TIMEOUT_S):
            raise EngineBusy(
                f"The engine was busy with other requests for {QUEUE_TIMEOUT_S:.0f} s; try again."
            )
        try:
            yield
        finally:
            self._lock.release()

    def load(
        self,
        model_dir: str | None = None,
        offload: OffloadConfig = OffloadConfig(),
        on_progress: Callable[[LoadProgress], None] | None = None,
    ) -> Loaded:
        with self.turn():
            return self._load(model_dir, offload, on_progress)

    def _load(self, model_dir, offload, on_progress=None) -> Loaded:
        request_id = self.next_id()
        self.worker.send(LoadModel(request_id, model_dir, offload))
        for event in self._events(request_id, LOAD_STALL_TIMEOUT_S):
            if isinstance(event, LoadProgress) and on_progress is not None:
                on_progress(event)
            elif isinstance(event, Loaded):
                self.model = event.model
                self._loaded_with = (model_dir, offload)
                return event
        raise AssertionError("unreachable: _events ends with Loaded, Finished or an exception")

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def restart(self) -> None:
        """Start a worker again (if it died) with the model it had, waiting for the session's turn."""
        with self.turn():
            self.ensure_worker()

    def ensure_worker(self) -> bool:
        """A worker that died is started again and reloads the model it had; True if it was restarted.

        Call within the session's turn (`generate` does)."""
        if self.worker.alive:
            return False
        self.worker.kill()  # closes the old pipe
        self.worker = WorkerProcess(self.worker.log_level)
        self.worker.start()
        if self._loaded_with is not None:
            self._load(*self._loaded_with)
        self.restarts += 1
        log.warning("The engine process had stopped; a new one was started and the model loaded again.")
        return True

    def generate(
        self,
        messages: list[ChatMessage],
        config: GenerationConfig = GenerationConfig(),
        completion: CompletionPrompt | None = None,
    ) -> Iterator[Token | Finished]:
        """Stream the reply: Token events, then one Finished. Closing the iterator early cancels.
        `completion`: a prompt continued as written, in place of the messages.

        Raises `RequestFailed` (the engine refused or failed the request), `WorkerDied` (the
        worker died or stalled: the next request starts a new one), `EngineBusy`."""
        with self.turn():
            self.ensure_worker()
            request_id = self.next_id()
            ended = False  # the worker is done with the request: Finished, or an Error
            try:
                self._send_generate(Generate(request_id, tuple(messages), config, completion))
                for event in self._events(request_id, STALL_TIMEOUT_S):
                    if isinstance(event, Token | Finished):
                        ended = isinstance(event, Finished)
                        yield event
            except RequestFailed:
                ended = True
                raise
            except InvalidRequestError:  # it never reached the worker
                ended = True
                raise
            finally:
                if not ended and self.worker.alive:
                    self._cancel_and_drain(request_id)

    def _send_generate(self, request: Generate) -> None:
        """Send a generation; a worker found dead on the way is started again, once."""
        try:
            self.worker.send(request)
        except WorkerDied:
            log.warning("The engine process had died; starting it again for this request.")
            self.ensure_worker()
            self.worker.send(request)

    def _cancel_and_drain(self, request_id: str) -> None:
        """Cancel a running request and read its events to the end; a worker that does not end it
        within `CANCEL_TIMEOUT_S` is killed (the next request starts a new one)."""
        try:
            self.worker.send(Cancel(self.next_id(), request_id))
            with contextlib.suppress(RequestFailed):
                for _ in self._events(request_id, CANCEL_TIMEOUT_S):
                    pass
        except WorkerDied:
            self.worker.kill()

    def cancel(self, request_id: str) -> None:
        self.worker.send(Cancel(self.next_id(), request_id))

    def stats(self, timeout_s: float = 5.0) -> Stats:
        """Fresh telemetry (only between requests: during one, see `last_stats`)."""
        with self.turn():
            request_id = self.next_id()
            self.worker.send(GetStats(request_id))
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                event = self.worker.poll(deadline - time.monotonic())
                if isinstance(event, Stats):
                    self.last_stats = event
                    if event.request_id == request_id:
                        return event
        raise WorkerDied(f"The engine did not answer within {timeout_s:.0f} s.")

    def _events(self, request_id: str, stall_timeout_s: float) -> Iterator[Event]:
        """Events of `request_id` until its last (Loaded, Finished; Error raises); keeps Stats.

        An Error the worker could not attribute (a message it could not read) is this request's:
        there is only one at a time. `stall_timeout_s` without any event kills the worker."""
        while True:
            event = self.worker.poll(stall_timeout_s)
            if event is None:
                self.worker.kill()
                raise WorkerDied(
                    f"The engine did not answer for {stall_timeout_s:.0f} s and was stopped; "
                    "the next request starts it again."
                )
            if isinstance(event, Stats):
                self.last_stats = event
                continue
            if isinstance(event, Notice):
                self.notices.append(event.message)
                log.warning("%s", event.message)
            if isinstance(event, Error) and event.request_id in (request_id, ""):
                raise RequestFailed(event)
            if event.request_id != request_id:
                continue
            yield event
            if isinstance(event, Loaded | Finished):
                return

    def close(self) -> None:
        self.worker.stop()
