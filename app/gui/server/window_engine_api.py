"""The window's engine as the local server's: the server answers with the model the window has
loaded, through the window's one worker, so the model is never loaded twice.

`WindowEngine` is `app.server.openai_api.ChatEngine` over the window's `EngineClient`. The
server's threads call `generate`; the request goes to the GUI thread (a queued signal), which
sends it to the worker like a chat reply, and the reply's events come back on a queue. The worker
runs one request at a time, so a request waits behind the chat's reply (and the chat behind it).
A reply whose worker crashed, or that the window's restart ended, ends with `WorkerDied`; the
window brings its engine back itself, and `restart` waits for that.

`LocalServer` runs `app.server.openai_server.ApiServer` over it, and sends the server's log
records (one line a request, one a reply) to `sig_log` for the window's request log.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from PySide6.QtCore import QObject, Qt, Signal

from app.gui.engine.engine_client import ConnectionState, EngineClient, ReplyText, WorkerCrashed
from engine.errors import EngineError
from engine.generation_config import CompletionPrompt, GenerationConfig
from engine.worker.client import QUEUE_TIMEOUT_S, STALL_TIMEOUT_S, EngineBusy, RequestFailed, WorkerDied
from engine.worker.protocol import ChatMessage, Error, Finished, Token

log = logging.getLogger(__name__)

MODEL_WAIT_S = 900.0  # how long a restart waits for the window to load its model again
NO_MODEL = "No model is loaded in MoE Chat right now (it may be loading); try again once it is."
SERVER_LOGGER = "app.server"


class WindowEngine(QObject):
    """`generate` from any thread; everything else on the GUI thread."""

    _sig_call = Signal(object)  # a function for the GUI thread to run
    sig_finished = Signal(object)
    """A reply of the server's ended whole (its `Finished`), for the dashboard's last-reply figures."""

    def __init__(
        self,
        client: EngineClient,
        parent: QObject | None = None,
        queue_timeout_s: float = QUEUE_TIMEOUT_S,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ):
        super().__init__(parent)
        self.client = client
        self.restarts = 0  # the window's engine died and was brought back
        self.model: dict | None = None  # the window's loaded model's `Loaded` info
        self.queue_timeout_s, self.stall_timeout_s = queue_timeout_s, stall_timeout_s
        self._ready = threading.Event()  # a model is loaded: requests can go to the worker
        self._replies: dict[str, queue.SimpleQueue] = {}  # the server's replies in flight (GUI thread)
        self._sig_call.connect(self._run, Qt.ConnectionType.QueuedConnection)
        client.sig_reply.connect(self._on_reply)
        client.sig_state_changed.connect(self._on_state)

    # -- ChatEngine ---------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self._ready.is_set()

    def restart(self) -> None:
        """The window restarts its engine after a crash and loads the model again: wait for that."""
        if not self._ready.wait(MODEL_WAIT_S):
            raise WorkerDied(f"MoE Chat's engine did not come back within {MODEL_WAIT_S:.0f} s.")

    def generate(
        self,
        messages: list[ChatMessage],
        config: GenerationConfig,
        completion: CompletionPrompt | None = None,
    ) -> Iterator[Token | Finished]:
        """The reply's `Token`s, then its `Finished`; closing it early cancels the reply."""
        if not self._ready.is_set():
            raise EngineBusy(NO_MODEL)
        events: queue.SimpleQueue = queue.SimpleQueue()
        sent: dict[str, str] = {}
        self._sig_call.emit(lambda: self._send((messages, config, completion), events, sent))
        ended, timeout_s, index = False, self.queue_timeout_s, 0
        try:
            while True:
                event = self._next(events, timeout_s)
                timeout_s = self.stall_timeout_s
                if isinstance(event, ReplyText):
                    reply = (event.text, -1, index, 0.0, event.reasoning, event.logprobs, event.echo)
                    yield Token(event.request_id, *reply)
                    index += event.tokens
                    continue
                ended = True
                if isinstance(event, Finished):
                    yield event
                    return
                raise event
        finally:
            cancel = not ended
            self._sig_call.emit(lambda: self._forget(sent.get("id"), cancel))

    # -- the window says -----------------------------------------------------------------------------

    def model_loaded(self, loaded: bool) -> None:
        """The window's model is loaded (requests go to it), or is being replaced or gone."""
        self._ready.set() if loaded else self._ready.clear()

    def end_replies(self, why: str) -> None:
        """End the server's replies in flight (cancelled in the worker) with `why`: the server stops."""
        for request_id, events in list(self._replies.items()):
            self.client.cancel(request_id)
            events.put(WorkerDied(why))
        self._replies.clear()

    # -- the GUI thread -------------------------------------------------------------------------------

    def _run(self, call: Callable[[], None]) -> None:
        call()

    def _send(self, request: tuple, events: queue.SimpleQueue, sent: dict[str, str]) -> None:
        if not self._ready.is_set():
            events.put(EngineBusy(NO_MODEL))
            return
        request_id = self.client.generate(*request)
        sent["id"] = request_id
        self._replies[request_id] = events

    def _forget(self, request_id: str | None, cancel: bool) -> None:
        if request_id is not None and self._replies.pop(request_id, None) is not None and cancel:
            self.client.cancel(request_id)

    def _on_reply(self, event) -> None:
        events = self._replies.get(event.request_id)
        if events is None:
            return  # the chat's
        if not isinstance(event, ReplyText):
            del self._replies[event.request_id]  # its last event
        if isinstance(event, Finished):
            self.sig_finished.emit(event)
        elif isinstance(event, Error):
            event = RequestFailed(event)
        elif isinstance(event, WorkerCrashed):
            event = WorkerDied(event.message)
        events.put(event)

    def _on_state(self, state: ConnectionState) -> None:
        if state is ConnectionState.READY:
            return
        self._ready.clear()  # until the window has loaded the model again
        if state is ConnectionState.DEAD:
            self.restarts += 1  # the crash ended the replies already (`WorkerCrashed`)
        elif state is ConnectionState.STOPPED:  # restarted or shut down: no end comes for them
            self.end_replies("The engine was restarted in MoE Chat's window.")

    def _next(self, events: queue.SimpleQueue, timeout_s: float):
        """The reply's next event; raises `EngineBusy` after `timeout_s` without one (the reply
        is then cancelled: it waited too long behind others, or the engine hangs)."""
        started = time.monotonic()
        try:
            return events.get(timeout=timeout_s)
        except queue.Empty:
            waited = time.monotonic() - started
            raise EngineBusy(f"MoE Chat's engine did not answer for {waited:.0f} s; try again.") from None


class LogLines(logging.Handler):
    """The server's log records as lines on a Qt signal: from any thread, to the GUI thread."""

    def __init__(self, signal):
        super().__init__(logging.INFO)
        self.signal = signal
        self.setFormatter(logging.Formatter("%(asctime)s  %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(RuntimeError):  # the window is gone while a server thread still logs
            self.signal.emit(self.format(record))


class LocalServer(QObject):
    """The OpenAI-compatible server on 127.0.0.1 over the window's engine, started and stopped
    from the window; `sig_log` carries its request log."""

    sig_log = Signal(str)
    """A line of the server's log: a request (method, path, status, time) or a reply's figures."""
    sig_changed = Signal()
    """It started or stopped, or the model it serves changed."""

    def __init__(self, client: EngineClient, parent: QObject | None = None):
        super().__init__(parent)
        self.engine = WindowEngine(client, self)
        self.model_id: str | None = None
        self.defaults = GenerationConfig()
        self._server = None  # app.server.openai_server.ApiServer while it runs
        self._backend = None
        self._log = LogLines(self.sig_log)

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def url(self) -> str | None:
        return self._server.url if self._server is not None else None

    def set_model(self, model_id: str | None, info: dict | None = None) -> None:
        """The name requests use for the window's loaded model (None: none is loaded now), and its
        `Loaded` info."""
        self.model_id = model_id or self.model_id
        self.engine.model = info if model_id is not None else None
        self.engine.model_loaded(model_id is not None)
        if self._backend is not None and model_id is not None:
            self._backend.model_id = model_id
        self.sig_changed.emit()

    def set_defaults(self, defaults: GenerationConfig) -> None:
        """What a request leaves out (speculation, prefetch, sampling): the window's settings."""
        self.defaults = defaults
        if self._backend is not None:
            self._backend.defaults = defaults

    def start(self, port: int, api_key: str | None = None) -> str:
        """Listen on 127.0.0.1:`port`; the server's URL. Raises `OSError` (the port is taken …)."""
        from app.server.openai_api import ChatBackend  # the server's stack loads when it is first used
        from app.server.openai_server import ApiServer

        if self._server is not None:
            return self._server.url
        backend = ChatBackend(self.engine, self.model_id or "none", self.defaults)
        try:
            server = ApiServer(backend, port, api_key=api_key).start()
        except (OSError, EngineError):
            backend.close()
            raise
        self._server, self._backend = server, backend
        logger = logging.getLogger(SERVER_LOGGER)
        logger.addHandler(self._log)
        logger.setLevel(logging.INFO)
        log.info("The local server listens at %s", server.url)
        self.sig_changed.emit()
        return server.url

    def stop(self) -> None:
        """End the replies in flight, then stop listening (within seconds)."""
        server, self._server = self._server, None
        if server is None:
            return
        logging.getLogger(SERVER_LOGGER).removeHandler(self._log)
        self.engine.end_replies("The local server was stopped.")
        server.stop()
        self._backend.close()
        self._backend = None
        self.sig_changed.emit()
