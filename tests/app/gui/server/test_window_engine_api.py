"""The window's engine as the server's (`WindowEngine`), over a stand-in `EngineClient`: a server
thread's request reaches the GUI thread, its events come back in order, and every way a reply can
end (finished, failed, crashed, restarted, abandoned, no model) ends the server's side too."""

import threading

import pytest
from PySide6.QtCore import QObject, Signal

from app.gui.engine.engine_client import ConnectionState, ReplyText, WorkerCrashed
from app.gui.server.window_engine_api import WindowEngine
from engine.generation_config import GenerationConfig
from engine.worker.client import EngineBusy, RequestFailed, WorkerDied
from engine.worker.protocol import ChatMessage, Error, Finished, Token

pytestmark = pytest.mark.gui

COW = [ChatMessage("user", "What sound does a cow make?")]


class StandInClient(QObject):
    """`EngineClient`'s signals and requests; the test emits the worker's events itself."""

    sig_reply = Signal(object)
    sig_state_changed = Signal(object)

    def __init__(self):
        super().__init__()
        self.generated, self.cancelled = [], []
        self.gui_thread = threading.get_ident()

    def generate(self, messages, config, completion=None) -> str:
        assert threading.get_ident() == self.gui_thread, "requests go to the worker from the GUI thread"
        self.generated.append((messages, config))
        return f"q{len(self.generated)}"

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


class Consumer:
    """A server thread reading one reply from `engine.generate`."""

    def __init__(self, engine: WindowEngine, stop_after: int | None = None):
        self.events, self.error, self.done = [], None, threading.Event()
        threading.Thread(target=self._run, args=(engine, stop_after), daemon=True).start()

    def _run(self, engine, stop_after) -> None:
        try:
            events = engine.generate(COW, GenerationConfig())
            for event in events:
                self.events.append(event)
                if stop_after is not None and len(self.events) == stop_after:
                    events.close()  # the client went away
                    break
        except Exception as err:
            self.error = err
        finally:
            self.done.set()


@pytest.fixture
def client(qtbot):
    return StandInClient()


def loaded_engine(client, **timeouts) -> WindowEngine:
    engine = WindowEngine(client, **timeouts)
    engine.model_loaded(True)
    return engine


def sent(qtbot, client, count: int = 1) -> str:
    qtbot.waitUntil(lambda: len(client.generated) == count, timeout=3000)
    return f"q{count}"


def test_a_reply_streams_back_to_the_server_thread_in_order(qtbot, client):
    engine = loaded_engine(client)
    ended = []
    engine.sig_finished.connect(ended.append)  # the window's dashboard shows its figures
    consumer = Consumer(engine)
    rid = sent(qtbot, client)
    client.sig_reply.emit(ReplyText("other", "the chat's reply", 3))  # not the server's: ignored
    client.sig_reply.emit(ReplyText(rid, "A cow", 2, "thinks", 1))
    client.sig_reply.emit(ReplyText(rid, " says moo.", 3))
    client.sig_reply.emit(Finished(rid, "eos", "A cow says moo.", "", 7, 5, {}))
    qtbot.waitUntil(consumer.done.is_set, timeout=3000)
    assert consumer.error is None
    tokens, finished = consumer.events[:-1], consumer.events[-1]
    assert [(t.text, t.reasoning, t.index) for t in tokens] == [("A cow", "thinks", 0), (" says moo.", "", 2)]
    assert all(isinstance(t, Token) for t in tokens) and finished.text == "A cow says moo."
    assert client.cancelled == [] and engine._replies == {} and ended == [finished]


@pytest.mark.parametrize(
    ("end", "raised"),
    [
        (lambda rid: Error(rid, "invalid_request", "max_new_tokens too large"), RequestFailed),
        (lambda rid: WorkerCrashed(rid, "The engine process stopped (signal 9)."), WorkerDied),
    ],
)
def test_a_failed_or_crashed_reply_raises_what_the_api_maps_to_a_status(qtbot, client, end, raised):
    engine = loaded_engine(client)
    consumer = Consumer(engine)
    rid = sent(qtbot, client)
    client.sig_reply.emit(end(rid))
    qtbot.waitUntil(consumer.done.is_set, timeout=3000)
    assert isinstance(consumer.error, raised) and client.cancelled == []


def test_closing_the_reply_early_cancels_it_in_the_worker(qtbot, client):
    engine = loaded_engine(client)
    consumer = Consumer(engine, stop_after=1)
    rid = sent(qtbot, client)
    client.sig_reply.emit(ReplyText(rid, "A cow", 2))
    qtbot.waitUntil(lambda: client.cancelled == [rid], timeout=3000)
    assert consumer.done.wait(3) and consumer.error is None and engine._replies == {}


def test_without_a_loaded_model_a_request_is_refused_at_once(qtbot, client):
    engine = WindowEngine(client)
    with pytest.raises(EngineBusy, match="No model is loaded"):
        next(engine.generate(COW, GenerationConfig()))
    assert client.generated == [] and not engine.alive


def test_the_windows_restart_ends_the_servers_replies_and_the_next_load_brings_it_back(qtbot, client):
    engine = loaded_engine(client)
    consumer = Consumer(engine)
    sent(qtbot, client)
    client.sig_state_changed.emit(ConnectionState.STOPPED)  # restart(): no end comes from the worker
    qtbot.waitUntil(consumer.done.is_set, timeout=3000)
    assert isinstance(consumer.error, WorkerDied) and "restarted" in str(consumer.error)
    assert not engine.alive
    waiting = threading.Thread(target=engine.restart, daemon=True)
    waiting.start()
    client.sig_state_changed.emit(ConnectionState.READY)
    assert waiting.is_alive(), "restart waits for the model, not just a worker"
    engine.model_loaded(True)
    waiting.join(3)
    assert not waiting.is_alive() and engine.alive


def test_a_crash_counts_as_a_restart_and_stops_new_requests_until_the_model_is_back(qtbot, client):
    engine = loaded_engine(client)
    client.sig_state_changed.emit(ConnectionState.DEAD)
    assert engine.restarts == 1 and not engine.alive
    with pytest.raises(EngineBusy):
        next(engine.generate(COW, GenerationConfig()))


def test_a_reply_with_no_answer_in_time_is_a_busy_engine(qtbot, client):
    engine = loaded_engine(client, queue_timeout_s=0.3)
    consumer = Consumer(engine)
    rid = sent(qtbot, client)
    qtbot.waitUntil(consumer.done.is_set, timeout=3000)
    assert isinstance(consumer.error, EngineBusy) and "did not answer" in str(consumer.error)
    qtbot.waitUntil(lambda: client.cancelled == [rid], timeout=3000)  # and it is cancelled
