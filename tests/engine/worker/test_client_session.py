"""`EngineSession` never waits without a bound and never keeps its turn after a failed request:
a scripted stand-in for the worker process plays each way a request can end."""

import threading

import pytest

import engine.worker.client as client
from engine.errors import InvalidRequestError
from engine.worker.client import EngineSession, RequestFailed, WorkerDied
from engine.worker.protocol import Cancel, ChatMessage, Error, Finished, Generate, Token

COW = [ChatMessage("user", "What sound does a cow make?")]


class ScriptedWorker:
    """Answers each Generate with the events its script has for that request's number."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)  # one list of events (request id "{id}" filled in) per Generate
        self.sent: list = []
        self.pending: list = []
        self.alive = True
        self.killed = False
        self.log_level = 0

    def send(self, request) -> None:
        client.encode_request(request)  # what cannot be encoded fails here, as in the real worker
        self.sent.append(request)
        if isinstance(request, Generate):
            script = self.scripts.pop(0)
            self.pending += [_with_id(e, request.request_id) for e in script]
        elif isinstance(request, Cancel):
            self.pending.append(Finished(request.target_id, "cancelled", "", "", 1, 0, {}))

    def poll(self, timeout_s=None):
        return self.pending.pop(0) if self.pending else None  # nothing more: a stall

    def kill(self) -> None:
        self.alive, self.killed = False, True


def _with_id(event, request_id):
    fields = dict(event.__dict__)
    if fields.get("request_id") == "{id}":
        fields["request_id"] = request_id
    return type(event)(**fields)


def token(text):
    return Token("{id}", text, 1, 0, 1.0)


def finished():
    return Finished("{id}", "eos", "moo", "", 3, 1, {})


def test_a_request_the_worker_refuses_releases_the_session_at_once():
    worker = ScriptedWorker([Error("{id}", "invalid_request", "bad seed")], [token("moo"), finished()])
    session = EngineSession(worker)
    with pytest.raises(RequestFailed, match="bad seed"):
        list(session.generate(COW))
    assert not any(isinstance(r, Cancel) for r in worker.sent), "an ended request is not cancelled"
    assert [type(e) for e in session.generate(COW)] == [Token, Finished]


def test_an_error_the_worker_could_not_attribute_ends_the_request():
    worker = ScriptedWorker([Error("", "protocol", "A message is not valid JSON")], [finished()])
    session = EngineSession(worker)
    with pytest.raises(RequestFailed, match="not valid JSON"):
        list(session.generate(COW))
    assert [type(e) for e in session.generate(COW)] == [Finished]


def test_text_that_cannot_be_sent_is_an_invalid_request_and_releases_the_session():
    worker = ScriptedWorker([finished()])
    session = EngineSession(worker)
    with pytest.raises(InvalidRequestError, match="cannot be sent"):
        list(session.generate([ChatMessage("user", "\ud800")]))
    assert [type(e) for e in session.generate(COW)] == [Finished]


def test_a_worker_that_goes_silent_is_killed_not_waited_for(monkeypatch):
    monkeypatch.setattr(client, "STALL_TIMEOUT_S", 0.01)
    worker = ScriptedWorker([token("moo")])  # and then nothing
    session = EngineSession(worker)
    with pytest.raises(WorkerDied, match="did not answer"):
        list(session.generate(COW))
    assert worker.killed


def test_closing_a_reply_early_cancels_it_and_reads_it_to_its_end():
    worker = ScriptedWorker([token("A"), token(" cow")], [finished()])
    session = EngineSession(worker)
    events = session.generate(COW)
    next(events)
    events.close()
    assert isinstance(worker.sent[-1], Cancel)
    assert [type(e) for e in session.generate(COW)] == [Finished]


def test_a_request_waits_for_its_turn_with_a_bound(monkeypatch):
    monkeypatch.setattr(client, "QUEUE_TIMEOUT_S", 0.05)
    session = EngineSession(ScriptedWorker())
    refused = []

    def ask() -> None:
        try:
            session.stats()
        except client.EngineBusy as err:
            refused.append(err)

    with session.turn():
        waiter = threading.Thread(target=ask)
        waiter.start()
        waiter.join(5)
    assert not waiter.is_alive() and refused
