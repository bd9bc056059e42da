"""The GUI's one owner of the engine worker process.

`EngineClient` starts the worker (spawn), sends it requests and turns its events
into Qt signals on the GUI thread. A reader thread blocks on the pipe and queues
events; a timer on the GUI thread drains the queue every `flush_ms`, merging a
request's consecutive tokens into one `ReplyText` and keeping only the newest
`Stats`, so a fast stream never floods the event loop. A dead worker is noticed
by the reader at once (the pipe closes) and reported within one flush.

A reply (a `generate` request) has one path: `sig_reply` carries its events in
order, `ReplyText`s and then exactly one of `Finished`, `Error` or `WorkerCrashed`.
Only a reply in flight when the caller itself calls `restart()` or `shutdown()`
gets no end: whoever stops the worker ends it.

Recovery is fast because the next worker is already there: once a model has loaded, a
standby worker (`engine.worker.standby`) is spawned `STANDBY_DELAY_MS` later and imports
torch, transformers and the model's code while the user chats; `restart()` (after a
crash, or asked for) wakes it instead of spawning a cold one, and the caller's load of
the model is then the only wait (the converted store comes from the store cache).

No torch import here: the GUI needs no CUDA context and starts fast.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from PySide6.QtCore import QObject, QTimer, Signal

from engine.config import OffloadConfig
from engine.errors import EngineError
from engine.generation_config import CompletionPrompt, GenerationConfig
from engine.worker.client import RequestFailed, WorkerDied, WorkerProcess
from engine.worker.protocol import (
    Cancel,
    ChatMessage,
    Error,
    Finished,
    Generate,
    GetStats,
    Loaded,
    LoadModel,
    LoadProgress,
    Notice,
    PromptEcho,
    Ready,
    Request,
    Stats,
    Token,
    Tune,
    TuneProgress,
    TuneResult,
)
from engine.worker.standby import StandbyWorker

log = logging.getLogger(__name__)

STANDBY_DELAY_MS = 3000  # after a load, and no reply streaming: the standby's imports take CPU


class ConnectionState(enum.Enum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    DEAD = "dead"


class _Died:
    def __init__(self, message: str):
        self.message = message


@dataclass(frozen=True)
class ReplyText:
    """New text of a reply: the `Token` events of one flush, merged."""

    request_id: str
    text: str  # the answer's
    tokens: int  # how many Token events it merges
    reasoning: str = ""  # the thinking's (a `<think>` block)
    reasoning_tokens: int = 0  # how many of the tokens carried thinking
    logprobs: tuple = ()  # the tokens' `TokenLogprob`s, when the request asked for them
    echo: PromptEcho | None = None  # the first's: a completion prompt sent back


@dataclass(frozen=True)
class WorkerCrashed:
    """The worker died while this reply was in flight: no `Finished` will come."""

    request_id: str
    message: str


ReplyEvent = ReplyText | Finished | Error | WorkerCrashed


class EngineClient(QObject):
    sig_state_changed = Signal(object)
    """The connection state changed (a `ConnectionState`)."""
    sig_ready = Signal(object)
    """The worker started and speaks our protocol (a `Ready` event)."""
    sig_load_progress = Signal(str, str, int, int)
    """Loading progress: request id, stage, done, total."""
    sig_loaded = Signal(str, dict)
    """A model finished loading: request id, model info."""
    sig_notice = Signal(str, str)
    """Something the user should know that is not an error: request id, message."""
    sig_reply = Signal(object)
    """A reply's event (a `ReplyEvent`): its `ReplyText`s, then one `Finished`, `Error` or `WorkerCrashed`."""
    sig_stats = Signal(object)
    """The newest telemetry (a `Stats` event)."""
    sig_tune_progress = Signal(str, str, int, int)
    """Auto-tune progress: request id, stage, done, total."""
    sig_tune_result = Signal(str, dict)
    """Auto-tune finished: request id, the result (probe, profile, prediction, measured, choice …)."""
    sig_error = Signal(str, str, str)
    """A request other than a reply failed: request id, error kind, message (the worker goes on)."""
    sig_worker_died = Signal(str)
    """The worker process is gone: why. Call `restart()` to start a new one."""

    def __init__(
        self,
        parent: QObject | None = None,
        worker_factory: Callable[[], WorkerProcess] = WorkerProcess,
        flush_ms: int = 50,
        standby_factory: Callable[[str | None], WorkerProcess] | None = StandbyWorker,
    ):
        super().__init__(parent)
        self._worker_factory = worker_factory
        self._standby_factory = standby_factory  # None: no standby worker, a restart starts cold
        self._local_factories = (worker_factory, standby_factory)  # what `use_engine(None)` returns to
        self._standby: WorkerProcess | None = None
        self._model_dir: str | None = None  # the last model asked for: the standby imports its code
        self._worker: WorkerProcess | None = None
        self._reader: threading.Thread | None = None
        self._inbox: deque = deque()  # events from the reader thread, in order
        self._outbox: list[Request] = []  # requests made before the worker was ready
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._replies: set[str] = set()  # request ids of the replies in flight
        self.state = ConnectionState.STOPPED
        self.ready: Ready | None = None
        self._timer = QTimer(self)
        self._timer.setInterval(flush_ms)
        self._timer.timeout.connect(self._flush)
        self._standby_timer = QTimer(self, singleShot=True, interval=STANDBY_DELAY_MS)
        self._standby_timer.timeout.connect(self._spawn_standby)

    # -- life cycle -----------------------------------------------------------------------------

    def start(self) -> None:
        """Start the worker in the background; `sig_ready` (or `sig_worker_died`) follows."""
        if self.state in (ConnectionState.STARTING, ConnectionState.READY):
            return
        self._set_state(ConnectionState.STARTING)
        self._worker = worker = self._take_standby() or self._worker_factory()
        self._reader = threading.Thread(target=self._read, args=(worker,), name="engine-reader", daemon=True)
        self._reader.start()
        self._timer.start()

    def use_engine(self, worker_factory: Callable[[], WorkerProcess] | None = None) -> None:
        """Talk to another engine from the next `start()`/`restart()`: a remote's worker factory
        (`app.settings.remotes.RemoteStore.worker_factory`; no standby: nothing to warm up), or None
        for the local worker this client was made with."""
        if worker_factory is None:
            self._worker_factory, self._standby_factory = self._local_factories
        else:
            self._worker_factory, self._standby_factory = worker_factory, None
        standby, self._standby = self._standby, None
        if standby is not None:  # the local standby is of no use to a remote
            standby.kill()

    def restart(self) -> None:
        """Kill any worker and start a new one (a model must then be loaded again)."""
        self._stop_worker(kill=True)
        self._set_state(ConnectionState.STOPPED)  # else `start()` takes a READY client for running
        self.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Ask the worker to exit (killing it after `timeout_s`); for application exit."""
        self._stop_worker(kill=False, timeout_s=timeout_s)
        self._timer.stop()
        self._standby_timer.stop()
        standby, self._standby = self._standby, None
        if standby is not None:
            standby.kill()
        self._set_state(ConnectionState.STOPPED)

    @property
    def standby_warm(self) -> bool:
        """True while a standby worker with its imports done waits for a restart."""
        return self._standby is not None and getattr(self._standby, "warm", True)

    def _take_standby(self) -> WorkerProcess | None:
        standby, self._standby = self._standby, None
        if standby is not None and not standby.alive:
            standby.kill()
            return None
        return standby

    def _spawn_standby(self) -> None:
        if (
            self._standby_factory is None
            or self._standby is not None
            or self.state is not ConnectionState.READY
        ):
            return
        if self._replies:  # a reply is streaming: spawn the standby once it is quiet
            self._standby_timer.start()
            return
        try:
            self._standby = self._standby_factory(self._model_dir)
        except OSError as err:  # no process to spare: restarts start cold
            log.warning("No standby engine process: %s", err)

    def _stop_worker(self, kill: bool, timeout_s: float = 5.0) -> None:
        worker, self._worker = self._worker, None
        with self._lock:
            self._outbox.clear()
        if worker is not None:
            worker.kill() if kill else worker.stop(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout_s)
        self._inbox.clear()
        self._replies.clear()
        self.ready = None

    # -- requests ----------------------------------------------------------------------------------

    def load_model(self, model_dir: str | None = None, offload: OffloadConfig = OffloadConfig()) -> str:
        """Load `model_dir` (None: the demo model); returns the request id."""
        self._model_dir = model_dir
        return self._request(lambda rid: LoadModel(rid, model_dir, offload))

    def generate(
        self,
        messages: Sequence[ChatMessage],
        config: GenerationConfig = GenerationConfig(),
        completion: CompletionPrompt | None = None,
    ) -> str:
        """Ask for a reply (to `messages`, or to a `completion` prompt); returns its request id.
        Its events come on `sig_reply`."""
        request_id = self._request(lambda rid: Generate(rid, tuple(messages), config, completion))
        self._replies.add(request_id)  # a send error is queued, so it is routed after this
        return request_id

    def tune(self, draft_model: str | None = None, new_tokens: int = 32, retune: bool = False) -> str:
        """Auto-tune the loaded model; returns the request id (cancel it with `cancel`)."""
        return self._request(lambda rid: Tune(rid, draft_model, new_tokens, retune))

    def cancel(self, request_id: str) -> None:
        self._request(lambda rid: Cancel(rid, request_id))

    def request_stats(self) -> str:
        return self._request(GetStats)

    def _request(self, make: Callable[[str], Request]) -> str:
        request = make(f"q{next(self._ids)}")
        with self._lock:
            if self.state is ConnectionState.STARTING:
                self._outbox.append(request)  # sent once the worker is ready
                return request.request_id
        self._send(request)
        return request.request_id

    def _send(self, request: Request) -> None:
        worker = self._worker
        try:
            if worker is None:
                raise WorkerDied("The engine is not running.")
            worker.send(request)
        except EngineError as err:
            self._inbox.append(Error(request.request_id, err.kind, str(err)))

    # -- the reader thread -------------------------------------------------------------------------

    def _read(self, worker: WorkerProcess) -> None:
        try:
            self._inbox.append(worker.start())
            while self._worker is worker:
                event = worker.poll(0.25)
                if event is not None:
                    self._inbox.append(event)
        except (WorkerDied, RequestFailed) as err:
            if self._worker is worker:  # not a worker we stopped on purpose
                self._inbox.append(_Died(str(err)))
        except EngineError as err:  # e.g. a protocol version mismatch
            self._inbox.append(_Died(str(err)))

    # -- the GUI thread ----------------------------------------------------------------------------

    def _flush(self) -> None:
        events = []
        while self._inbox:
            events.append(self._inbox.popleft())
        newest_stats = None
        pending_tokens: dict[str, list[Token]] = {}
        for event in events:
            if isinstance(event, Stats):
                newest_stats = event
            elif isinstance(event, Token):
                pending_tokens.setdefault(event.request_id, []).append(event)
            else:
                self._emit_tokens(pending_tokens)  # tokens stay ahead of their Finished
                self._emit(event)
        self._emit_tokens(pending_tokens)
        if newest_stats is not None:
            self.sig_stats.emit(newest_stats)

    def _emit_tokens(self, pending: dict[str, list[Token]]) -> None:
        for request_id, tokens in pending.items():
            text, reasoning = "".join(t.text for t in tokens), "".join(t.reasoning for t in tokens)
            thinking = sum(1 for t in tokens if t.reasoning)
            logprobs = tuple(entry for t in tokens for entry in t.logprobs)
            echo = tokens[0].echo
            self.sig_reply.emit(ReplyText(request_id, text, len(tokens), reasoning, thinking, logprobs, echo))
        pending.clear()

    def _emit(self, event) -> None:
        match event:
            case Ready():
                self.ready = event
                self._set_state(ConnectionState.READY)
                with self._lock:
                    outbox, self._outbox = self._outbox, []
                for request in outbox:
                    self._send(request)
                self.sig_ready.emit(event)
            case LoadProgress(request_id=rid, stage=stage, done=done, total=total):
                self.sig_load_progress.emit(rid, stage, done, total)
            case Loaded(request_id=rid, model=model):
                if self._standby is None:
                    self._standby_timer.start()
                self.sig_loaded.emit(rid, model)
            case Notice(request_id=rid, message=message):
                self.sig_notice.emit(rid, message)
            case Finished() | Error() if event.request_id in self._replies:
                self._replies.discard(event.request_id)
                self.sig_reply.emit(event)
            case TuneProgress(request_id=rid, stage=stage, done=done, total=total):
                self.sig_tune_progress.emit(rid, stage, done, total)
            case TuneResult(request_id=rid, result=result):
                self.sig_tune_result.emit(rid, result)
            case Error(request_id=rid, kind=kind, message=message):
                self.sig_error.emit(rid, kind, message)
            case _Died(message=message):
                dead, self._worker = self._worker, None
                if dead is not None:
                    dead.kill()
                replies, self._replies = self._replies, set()
                for request_id in replies:  # the replies end before the worker's death is told
                    self.sig_reply.emit(WorkerCrashed(request_id, message))
                self._set_state(ConnectionState.DEAD)
                self.sig_worker_died.emit(message)

    def _set_state(self, state: ConnectionState) -> None:
        if state is not self.state:
            self.state = state
            self.sig_state_changed.emit(state)
