"""The worker process: runs the engine for one client over a duplex pipe.

The client (the GUI's `EngineClient`, the terminal chat, the local server) starts
`worker_main` with the `spawn` context and speaks `engine.worker.protocol` to it. Inside:

    main thread       reads requests; Cancel, GetStats and Shutdown are answered at once
    engine thread     runs LoadModel and Generate one at a time, streaming their events
    telemetry thread  sends Stats at ~4 Hz while generating, ~1 Hz idle
    parent watch      exits the process when the parent dies (no orphans)

A request that fails is answered with an `Error` event and the worker keeps
serving; a malformed message too. Device out-of-memory is retried once with half
the expert cache, and a `Notice` says so.
"""

from __future__ import annotations

import gc
import json
import logging
import multiprocessing
import multiprocessing.connection
import os
import platform
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import torch

from engine.config import ExpertBudget
from engine.errors import DeviceOutOfMemoryError, EngineError, GenerationCancelled, InvalidRequestError
from engine.generation import FinishedEvent, generate
from engine.loader import load_model, resolve_device
from engine.metrics import LiveGeneration
from engine.resources import demo_draft_dir, demo_model_dir
from engine.text.reasoning import thinks
from engine.worker.protocol import (
    PROTOCOL_VERSION,
    Cancel,
    DeviceInfo,
    Error,
    Finished,
    Generate,
    GetStats,
    Loaded,
    LoadModel,
    LoadProgress,
    Notice,
    ProtocolError,
    Ready,
    Shutdown,
    Token,
    Tune,
    TuneProgress,
    TuneResult,
    dumps,
    loads,
)
from engine.worker.telemetry import Telemetry
from engine.worker.tuned import tuned_config

log = logging.getLogger(__name__)

PROGRESS_INTERVAL_S = 0.05
SHUTDOWN_GRACE_S = 30.0


def worker_main(conn: multiprocessing.connection.Connection, log_level: int = logging.WARNING) -> None:
    """The spawned process's entry point."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C in a terminal is for the client to handle
    logging.basicConfig(level=log_level, format="worker: %(levelname)s %(message)s")
    _exit_with_parent()
    Worker(conn).serve()


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        log.warning("The parent process is gone: the worker exits.")
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@dataclass
class _Job:
    request: LoadModel | Generate | Tune
    cancel: threading.Event = field(default_factory=threading.Event)


class Worker:
    def __init__(self, conn: multiprocessing.connection.Connection):
        self.conn = conn
        self.model = None
        self.model_is_demo = False
        self.telemetry = Telemetry()
        self._send_lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._active: dict[str, _Job] = {}  # queued or running, by request id
        self._generating_id = ""
        self._stopping = threading.Event()
        self._tick = threading.Event()  # wakes the telemetry thread early

    # -- the main thread ----------------------------------------------------------------------------

    def serve(self) -> None:
        self.send(Ready("", PROTOCOL_VERSION, os.getpid(), _device_info()))
        engine = threading.Thread(target=self._run_jobs, name="engine", daemon=True)
        telemetry = threading.Thread(target=self._run_telemetry, name="telemetry", daemon=True)
        engine.start()
        telemetry.start()
        try:
            while not self._stopping.is_set():
                try:
                    data = self.conn.recv_bytes()
                except (EOFError, OSError):
                    log.info("The client closed the connection.")
                    break
                if not self._dispatch(data):
                    break
        finally:
            self._shut_down(engine, telemetry)

    def _dispatch(self, data: bytes) -> bool:
        """Act on one message; False when it was Shutdown."""
        try:
            request = loads(data, expect="request")
        except ProtocolError as err:
            self.send(Error(_request_id_of(data), err.kind, str(err)))
            return True
        match request:
            case Cancel(target_id=target):
                job = self._active.get(target)
                if job is not None:
                    job.cancel.set()
            case GetStats(request_id=request_id):
                self.send(self.telemetry.sample(request_id))
            case Shutdown():
                return False
            case LoadModel() | Generate() | Tune():
                if request.request_id in self._active:
                    self.send(Error(request.request_id, "protocol", "This request id is already in use."))
                else:
                    job = _Job(request)
                    self._active[request.request_id] = job
                    self._jobs.put(job)
        return True

    def _shut_down(self, engine: threading.Thread, telemetry: threading.Thread) -> None:
        """Stop both threads before the model goes: a daemon thread still running (or dropping the
        last reference to a tensor) while the interpreter finalizes aborts the process."""
        self._stopping.set()
        for job in list(self._active.values()):
            job.cancel.set()
        self._jobs.put(None)
        self._tick.set()
        engine.join(SHUTDOWN_GRACE_S)
        telemetry.join(SHUTDOWN_GRACE_S)
        self._unload()

    def send(self, event) -> None:
        try:
            data = dumps(event)
        except (ValueError, TypeError) as err:  # text JSON cannot carry: that request fails, not the worker
            log.error("Cannot send %s: %s", type(event).__name__, err)
            message = f"The engine produced text it cannot send: {err}"
            data = dumps(Error(event.request_id, "internal", message))
        try:
            with self._send_lock:
                self.conn.send_bytes(data)
        except (BrokenPipeError, EOFError, OSError):  # the client is gone; the main thread notices
            self._stopping.set()

    # -- the engine thread ----------------------------------------------------------------------

    def _run_jobs(self) -> None:
        while (job := self._jobs.get()) is not None:
            request_id = job.request.request_id
            try:
                match job.request:
                    case LoadModel():
                        self._load(job.request, job.cancel)
                    case Generate():
                        self._generate(job.request, job.cancel)
                    case Tune():
                        self._tune(job.request, job.cancel)
            except EngineError as err:
                self.send(Error(request_id, err.kind, str(err)))
            except Exception as err:  # a bug: report it, keep serving
                log.exception("Request %s failed", request_id)
                self.send(Error(request_id, "internal", f"Internal error: {type(err).__name__}: {err}"))
            finally:
                self._active.pop(request_id, None)

    def _load(self, request: LoadModel, cancel: threading.Event) -> None:
        request.offload.validate()
        self._unload()  # free the old model's memory before the new one takes it
        folder = request.model_dir or str(demo_model_dir())
        progress = _Throttled(
            lambda *a: self.send(LoadProgress(request.request_id, *a)), cancel, self, "Loading"
        )
        started = time.perf_counter()
        try:
            model = load_model(folder, request.offload, progress)
        except DeviceOutOfMemoryError as err:
            smaller = smaller_budget(request.offload.expert_budget, err.cache_slots)
            if smaller is None:
                raise
            notice = f"{err} Retrying once with a smaller expert cache: {smaller}."
            self.send(Notice(request.request_id, notice))
            model = load_model(folder, replace(request.offload, expert_budget=smaller), progress)
        self.model, self.model_is_demo = model, request.model_dir is None
        self.telemetry.attach(model)
        info = asdict(model.info()) | {"thinks": thinks(model.tokenizer)}  # a <think> block: a Think toggle
        self.send(Loaded(request.request_id, info, time.perf_counter() - started))

    def _unload(self) -> None:
        if self.model is None:
            return
        self.telemetry.attach(None)
        model, self.model = self.model, None
        model.close()
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _generate(self, request: Generate, cancel: threading.Event) -> None:
        if self.model is None:
            raise InvalidRequestError("No model is loaded: load one first.")
        config = request.config
        if config.spec.mode == "draft" and not config.spec.draft_model and self.model_is_demo:
            config = replace(config, spec=replace(config.spec, draft_model=str(demo_draft_dir())))
        # `auto` (every front-end's default): the model's drafter and SP-MoE, at the tuned settings
        config = tuned_config(self.model, config)
        messages = request.completion or [m.to_template() for m in request.messages]
        self._generating_id = request.request_id
        try:
            self._stream(request.request_id, messages, config, cancel)
        except DeviceOutOfMemoryError as err:
            slots = self._shrink_cache()
            if slots is None:
                raise
            if err.tokens_sent:  # part of the reply is out: the client decides whether to send it again
                message = f"{err} The expert cache now has {slots} slots; send the message again."
                raise DeviceOutOfMemoryError(message) from err
            self.send(Notice(request.request_id, f"{err} Retrying once with {slots} expert cache slots."))
            self._stream(request.request_id, messages, config, cancel)
        finally:
            self.telemetry.end()
            self.send(self.telemetry.sample(request.request_id))  # the run's final counters
            self._generating_id = ""

    def _stream(self, request_id: str, messages, config, cancel: threading.Event) -> None:
        sent = 0
        live = LiveGeneration(time.perf_counter())
        self.telemetry.begin(live, config.spec.mode, config.prefetch)
        self._tick.set()
        try:
            for event in generate(self.model, messages, config, cancel, live):
                if isinstance(event, FinishedEvent):
                    self.telemetry.end()  # a GetStats answered after Finished must not say generating
                    self.send(
                        Finished(
                            request_id,
                            event.reason,
                            event.text,
                            event.tail,
                            event.stats.prompt_tokens,
                            event.stats.generated_tokens,
                            event.stats.to_dict(),
                            event.reasoning,
                            event.reasoning_tail,
                            event.tool_calls,
                        )
                    )
                else:
                    logprobs = () if event.logprob is None else (event.logprob,)
                    token = Token(
                        request_id,
                        event.text,
                        event.token_id,
                        event.index,
                        event.elapsed_ms,
                        event.reasoning,
                        logprobs,
                        event.echo,
                    )
                    self.send(token)
                    sent += 1
        except DeviceOutOfMemoryError as err:
            err.tokens_sent = sent
            raise

    def _tune(self, request: Tune, cancel: threading.Event) -> None:
        from engine.tune.run import TuneConfig, tune  # imported on first use: the worker starts faster

        if self.model is None:
            raise InvalidRequestError("No model is loaded: load one before tuning.")
        draft_model = request.draft_model
        if draft_model is None and self.model_is_demo:
            draft_model = str(demo_draft_dir())
        config = TuneConfig(draft_model=draft_model, new_tokens=request.new_tokens, retune=request.retune)
        progress = _Throttled(
            lambda *a: self.send(TuneProgress(request.request_id, *a)), cancel, self, "Tuning"
        )
        result = tune(self.model, config, progress=progress, cancel=cancel)
        self.send(TuneResult(request.request_id, asdict(result)))

    def _shrink_cache(self) -> int | None:
        """Halve the expert cache (never below one token's experts); None when it cannot shrink."""
        cache = self.model.cache
        slots = max(cache.n_slots // 2, self.model.top_k)
        if slots >= cache.n_slots:
            return None
        cache.resize(slots)
        return slots

    # -- the telemetry thread -------------------------------------------------------------------

    def _run_telemetry(self) -> None:
        while not self._stopping.is_set():
            self._tick.wait(self.telemetry.interval_s)
            self._tick.clear()
            if self._stopping.is_set():
                break
            try:
                self.send(self.telemetry.sample(self._generating_id))
            except Exception:  # telemetry must never take the worker down
                log.exception("Telemetry sample failed")


class _Throttled:
    """A progress callback: sends (stage, done, total) when the stage changes, at its end, and
    otherwise at most every PROGRESS_INTERVAL_S; raises `GenerationCancelled` once cancelled."""

    def __init__(
        self, send: Callable[[str, int, int], None], cancel: threading.Event, worker: Worker, what: str
    ):
        self.send, self.cancel, self.worker, self.what = send, cancel, worker, what
        self._last = 0.0
        self._stage = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.cancel.is_set() or self.worker._stopping.is_set():
            raise GenerationCancelled(f"{self.what} was cancelled.")
        now = time.perf_counter()
        if stage != self._stage or done >= total or now - self._last >= PROGRESS_INTERVAL_S:
            self._last, self._stage = now, stage
            self.send(stage, done, total)


def smaller_budget(budget: ExpertBudget, tried_slots: int | None) -> ExpertBudget | None:
    """Half of what did not fit, as a number of experts; None when nothing smaller can be tried."""
    if tried_slots is not None and tried_slots >= 2:
        return ExpertBudget(experts=tried_slots // 2)
    if budget.experts is not None and budget.experts >= 2:
        return ExpertBudget(experts=budget.experts // 2)
    if budget.nbytes is not None:
        return ExpertBudget(nbytes=budget.nbytes // 2)
    return None


def _device_info() -> DeviceInfo:
    device = resolve_device("auto")
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo("cuda", props.name, int(props.total_memory), str(torch.__version__))
    name = platform.processor() or platform.machine() or "CPU"
    return DeviceInfo("cpu", name, None, str(torch.__version__))


def _request_id_of(data: bytes) -> str:
    """The request id of a message that failed to decode, when it has a readable one."""
    try:
        request_id = json.loads(data).get("request_id", "")
    except (ValueError, AttributeError):
        return ""
    return request_id if isinstance(request_id, str) else ""
