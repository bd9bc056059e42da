"""`RemoteWorker`: the worker process's interface (`engine.worker.client.WorkerProcess`) over an
OpenAI-compatible server, so the GUI, the terminal chat and the Python API use a remote engine
unchanged.

`start()` lists the server's models (a bad address, key or certificate fails here, as a
`RemoteError`) and returns a `Ready` whose device kind is "remote". `send()` never blocks on the
network: each request runs on its own thread and its events come out of `poll()` in order:
- `LoadModel(model_dir=ID)` picks model ID (None: the endpoint's default, else the first listed)
  and answers `Loaded` (model info with "remote": True, "model_id", "models", "max_model_len");
- `Generate` streams `Token`s and one `Finished` (`engine.remote.openai_chat`); a failure before
  any text is an `Error` whose kind is a `RemoteError` kind, a failure after some text a
  `Finished(reason="interrupted")` keeping the text, with `stats["error"]` = {kind, message,
  retry_after_s}. Either way the worker stays usable: sending the request again is the retry;
- `Cancel` closes the reply's stream and ends it with `Finished(reason="cancelled")`;
- `GetStats` answers `Stats` at once from what is known (see `remote_stats`); `Tune` is refused.
A telemetry thread also sends `Stats` (4 Hz while a reply streams, 1 Hz idle; `/metrics` read
every `METRICS_EVERY_S`), which keeps `EngineSession`'s stall watch quiet while a remote thinks.

Every wait has a bound: connecting `RemoteTimeouts.connect_s`, each chunk of a reply `read_s`
(below `EngineSession`'s stall timeout), the model list `request_s`, /metrics 2 s. `kill()` and
`stop()` close every connection; `alive` is then False and `poll` raises `WorkerDied`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import openai
import psutil

from engine.errors import EngineError, InvalidRequestError
from engine.remote.endpoint import RemoteEndpoint
from engine.remote.errors import MODEL_NOT_FOUND, PROTOCOL, STREAM_CUT, UNSUPPORTED, RemoteError, classify
from engine.remote.metrics import RemoteMetrics, fetch_metrics
from engine.remote.openai_chat import ReplyAssembler, chat_arguments
from engine.remote.stats import remote_stats_event
from engine.worker.client import WorkerDied
from engine.worker.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    DeviceInfo,
    Error,
    Event,
    Generate,
    GetStats,
    Loaded,
    LoadModel,
    Ready,
    Request,
    Shutdown,
    Stats,
    Tune,
)

log = logging.getLogger(__name__)

METRICS_EVERY_S = 2.0
CLOSE_QUIET_AFTER_S = 2.0  # a cancelled reply whose server sends nothing this long is cut off
_CLOSED = object()  # put in the event queue when the worker closes: a blocked poll wakes up


@dataclass(frozen=True)
class RemoteTimeouts:
    connect_s: float = 10.0
    read_s: float = 90.0  # between two chunks (the first comes after the prompt's prefill)
    request_s: float = 30.0  # the model list


class _Reply:
    """A reply in flight: its events go out through `put` until its one last event (`end`)."""

    def __init__(self, assembler: ReplyAssembler, events: queue.Queue):
        self.assembler, self.events = assembler, events
        self.cancelled = threading.Event()
        self.stream: Any = None
        self._ended = False
        self._lock = threading.Lock()

    @property
    def ended(self) -> bool:
        return self._ended

    def put(self, event: Event) -> None:
        with self._lock:
            if not self._ended:
                self.events.put(event)

    def end(self, event: Event) -> None:
        """The reply's last event (Finished or Error), sent once: a later one is dropped."""
        with self._lock:
            if not self._ended:
                self._ended = True
                self.events.put(event)

    def cancel(self) -> None:
        """Mark the reply cancelled: the reader stops at the next chunk. A server quiet for
        `CLOSE_QUIET_AFTER_S` (a long prefill, a wedged server) is not waited for: the reply ends
        cancelled and its stream is closed from here. Not at once, because closing under a reading
        thread stalls both for seconds (llama.cpp's server does) instead of until the next chunk."""
        self.cancelled.set()
        threading.Thread(target=self._end_if_quiet, name="remote-cancel", daemon=True).start()

    def _end_if_quiet(self) -> None:
        deadline = time.monotonic() + CLOSE_QUIET_AFTER_S
        while time.monotonic() < deadline:
            with self._lock:
                if self._ended:
                    return
            time.sleep(0.05)
        self.end(self.assembler.finish("cancelled"))
        if self.stream is not None:
            self.stream.close()


class RemoteWorker:
    """A remote engine behind `WorkerProcess`'s start/send/poll/alive/stop/kill."""

    def __init__(
        self,
        endpoint: RemoteEndpoint,
        api_key: str | None = None,
        timeouts: RemoteTimeouts = RemoteTimeouts(),
        log_level: int = logging.WARNING,
    ):
        self.endpoint, self.timeouts, self.log_level = endpoint, timeouts, log_level
        self._api_key = api_key or None
        self.ready: Ready | None = None
        self.model: str | None = None  # the model id replies use, once loaded
        self.model_info: dict[str, Any] = {}
        self.metrics = RemoteMetrics(error="not read yet")
        self.last_reply: dict[str, Any] | None = None  # the last finished reply's timing
        self._client: openai.OpenAI | None = None
        self._events: queue.Queue = queue.Queue()
        self._replies: dict[str, _Reply] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._stats_waiting = threading.Event()  # an unread telemetry Stats is queued: send no more
        self._metrics_at = 0.0

    def reopened(self) -> RemoteWorker:
        """A new worker for the same endpoint, key and timeouts (after this one was closed)."""
        return RemoteWorker(self.endpoint, self._api_key, self.timeouts, self.log_level)

    def __repr__(self) -> str:  # never the key
        return f"RemoteWorker({self.endpoint.base_url!r}, model={self.model!r})"

    # -- WorkerProcess's interface -----------------------------------------------------------------

    def start(self, timeout_s: float | None = None) -> Ready:
        """Check the server answers (its model list) and return `Ready`; raises `RemoteError`."""
        timeout = openai.Timeout(
            connect=self.timeouts.connect_s,
            read=self.timeouts.read_s,
            write=30.0,
            pool=self.timeouts.connect_s,
        )
        # an explicit placeholder: the client must not fall back to $OPENAI_API_KEY and send it here
        self._client = openai.OpenAI(
            base_url=self.endpoint.base_url, api_key=self._api_key or "none", max_retries=0, timeout=timeout
        )
        self._list_models(timeout_s or self.timeouts.request_s)
        device = DeviceInfo("remote", f"{self.endpoint.name} ({self.endpoint.base_url})", None, "")
        self.ready = Ready("", PROTOCOL_VERSION, os.getpid(), device)
        threading.Thread(target=self._telemetry, name="remote-telemetry", daemon=True).start()
        return self.ready

    @property
    def alive(self) -> bool:
        return self._client is not None and not self._closed.is_set()

    def send(self, request: Request) -> None:
        if not self.alive:
            raise WorkerDied(f"The connection to {self.endpoint.base_url} is closed.")
        match request:
            case Generate():
                self._spawn(self._generate, request)
            case LoadModel():
                self._spawn(self._load, request)
            case Cancel(target_id=target):
                with self._lock:
                    reply = self._replies.get(target)
                if reply is not None:
                    reply.cancel()
            case GetStats(request_id=rid):
                self._events.put(self._stats(rid))
            case Tune(request_id=rid):
                self._events.put(
                    Error(
                        rid,
                        UNSUPPORTED,
                        "Auto-tune measures this computer: it runs on the local engine only.",
                    )
                )
            case Shutdown():
                self.stop()

    def poll(self, timeout_s: float | None = None) -> Event | None:
        """The next event, or None after `timeout_s`; raises `WorkerDied` once the worker is closed."""
        if self._closed.is_set() and self._events.empty():
            raise WorkerDied(f"The connection to {self.endpoint.base_url} is closed.")
        try:
            event = self._events.get(timeout=timeout_s)
        except queue.Empty:
            return None
        if event is _CLOSED:
            raise WorkerDied(f"The connection to {self.endpoint.base_url} is closed.")
        if isinstance(event, Stats) and event.request_id == "":
            self._stats_waiting.clear()
        return event

    def stop(self, timeout_s: float = 10.0) -> None:
        self.kill()

    def kill(self) -> None:
        """Close every connection: replies in flight end (cancelled), later calls raise `WorkerDied`."""
        if self._closed.is_set():
            return
        self._closed.set()
        with self._lock:
            replies = list(self._replies.values())
        for reply in replies:
            reply.cancel()
        if self._client is not None:
            self._client.close()
        self._events.put(_CLOSED)

    # -- requests ------------------------------------------------------------------------------

    def _spawn(self, target, request: Request) -> None:
        threading.Thread(
            target=target, args=(request,), name=f"remote-{request.request_id}", daemon=True
        ).start()

    def _list_models(self, timeout_s: float) -> list[Any]:
        try:
            return list(self._client.models.list(timeout=timeout_s))
        except Exception as err:  # the client's errors, classified for the user
            raise classify(err, self.endpoint.base_url) from err

    def _load(self, request: LoadModel) -> None:
        started = time.perf_counter()
        try:
            self.model_info = self._choose_model(request.model_dir)
        except RemoteError as err:
            self._events.put(Error(request.request_id, err.kind, str(err)))
            return
        self.model = self.model_info["model_id"]
        self._events.put(Loaded(request.request_id, self.model_info, time.perf_counter() - started))

    def _choose_model(self, wanted: str | None) -> dict[str, Any]:
        models = self._list_models(self.timeouts.request_s)
        ids = [m.id for m in models]
        chosen = wanted or self.endpoint.model or (ids[0] if ids else None)
        if chosen is None or chosen not in ids:
            served = ", ".join(ids) or "no models"
            raise RemoteError(
                MODEL_NOT_FOUND, f"{self.endpoint.base_url} does not serve {chosen!r}; it serves {served}."
            )
        card = models[ids.index(chosen)]
        extra = card.model_extra or {}
        return {
            "remote": True,
            "model_type": "remote",
            "device": "remote",
            "endpoint": self.endpoint.name,
            "base_url": self.endpoint.base_url,
            "model_id": chosen,
            "models": ids,
            "owned_by": getattr(card, "owned_by", None),
            "max_model_len": extra.get("max_model_len"),  # vLLM says it; others do not
            "thinks": None,  # not known from here: reasoning shows as it comes
        }

    def _generate(self, request: Generate) -> None:
        rid = request.request_id
        try:
            request.config.validate()
            if request.completion is not None:
                raise InvalidRequestError(
                    "A remote engine takes chat messages: completing a prompt as written "
                    "(/v1/completions) needs a model loaded on this computer."
                )
            if self.model is None:
                self.model_info = self._choose_model(None)
                self.model = self.model_info["model_id"]
        except EngineError as err:
            self._events.put(Error(rid, err.kind, str(err)))
            return
        reply = _Reply(ReplyAssembler(rid), self._events)
        with self._lock:
            self._replies[rid] = reply
        try:
            reply.end(self._stream(request, reply))
        finally:
            with self._lock:
                self._replies.pop(rid, None)
            self.last_reply = reply.assembler.timing()

    def _stream(self, request: Generate, reply: _Reply) -> Event:
        """Stream the reply's Tokens into the queue; its last event (Finished or Error) is returned."""
        assembler, url = reply.assembler, self.endpoint.base_url
        try:
            reply.stream = self._client.chat.completions.create(
                **chat_arguments(self.model, request.messages, request.config)
            )
            with reply.stream:
                for chunk in reply.stream:
                    if reply.cancelled.is_set():
                        break
                    token = assembler.feed(chunk)
                    if token is not None:
                        reply.put(token)
        except Exception as err:  # classified below: every failure ends the reply with a clear event
            if reply.cancelled.is_set():
                return assembler.finish("cancelled")
            error = classify(err, url, during_reply=assembler.received)
            log.info("Remote reply %s failed: %s", request.request_id, error)
            if assembler.received:
                return assembler.finish("interrupted", error.to_dict())
            return Error(request.request_id, error.kind, str(error))
        if reply.cancelled.is_set():
            return assembler.finish("cancelled")
        if assembler.finish_reason is None and not assembler.received:
            why = f"{url} answered with something that is not the OpenAI API's streamed reply."
            return Error(request.request_id, PROTOCOL, why)
        if assembler.finish_reason is None:  # the body ended cleanly but the reply never did
            cut = RemoteError(
                STREAM_CUT, f"{url} ended the reply without finishing it; the part received is kept."
            )
            return assembler.finish("interrupted", cut.to_dict())
        return assembler.finish()

    # -- telemetry -------------------------------------------------------------------------------

    def _stats(self, request_id: str):
        with self._lock:
            live = [r.assembler for r in self._replies.values() if not r.ended]
        reply = live[0].timing() if live else self.last_reply
        memory = psutil.virtual_memory()
        return remote_stats_event(
            request_id,
            endpoint=self.endpoint,
            model=self.model,
            generating=bool(live),
            reply=reply,
            metrics=self.metrics,
            host_ram=(memory.total - memory.available, memory.total),
            process_rss=psutil.Process().memory_info().rss,
        )

    def _telemetry(self) -> None:
        while not self._closed.is_set():
            if time.monotonic() - self._metrics_at >= METRICS_EVERY_S:
                self.metrics = fetch_metrics(self.endpoint.metrics_url, self._api_key)
                self._metrics_at = time.monotonic()
            if not self._stats_waiting.is_set() and not self._closed.is_set():
                self._stats_waiting.set()
                self._events.put(self._stats(""))
            with self._lock:
                generating = any(not r.ended for r in self._replies.values())
            self._closed.wait(0.25 if generating else 1.0)
