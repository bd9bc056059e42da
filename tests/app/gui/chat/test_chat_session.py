"""A reply's lifecycle in ChatSession, against a fake client: every ending, its reason, one end signal."""

import pytest
from PySide6.QtCore import QObject, Signal

from app.gui.chat.chat_bubbles import UserBubble
from app.gui.chat.chat_session import ChatSession, FinishReason
from app.gui.chat.chat_view import ChatView
from app.gui.engine.engine_client import ReplyText, WorkerCrashed
from app.gui.window.main_window import MainWindow
from app.settings import AppSettings
from app.storage import ConversationStore
from engine.worker.protocol import Error, Finished

pytestmark = pytest.mark.gui


class FakeClient(QObject):
    """EngineClient's reply side: `sig_reply`, with `generate` and `cancel` recorded; no worker."""

    sig_reply = Signal(object)

    def __init__(self):
        super().__init__()
        self.generated: list[list] = []
        self.cancelled: list[str] = []

    def generate(self, messages, config) -> str:
        self.generated.append(messages)
        return f"reply-{len(self.generated)}"

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)


@pytest.fixture
def store(tmp_path):
    conversations = ConversationStore(tmp_path / "conversations.db")
    yield conversations
    conversations.close()


@pytest.fixture
def client():
    return FakeClient()


@pytest.fixture
def session(qtbot, store, client):
    view = ChatView()
    qtbot.addWidget(view)
    return ChatSession(store, client, view, lambda: AppSettings())


@pytest.fixture
def ended(session):
    replies = []
    session.sig_reply_ended.connect(replies.append)
    return replies


def _finished(request_id: str, reason: str, text: str = "Hello") -> Finished:
    return Finished(request_id, reason, text, "", 5, 2, {"generated_tokens": 2})


def _finish(reason: str, text: str = "Hello"):
    return lambda session, client, rid: client.sig_reply.emit(_finished(rid, reason, text))


def _stop(session, client, rid):
    session.stop()
    assert client.cancelled == [rid] and session.busy, "Stop asks; the engine's answer ends the reply"
    client.sig_reply.emit(_finished(rid, "cancelled", "Hel"))


def _open_another(session, client, rid):
    session.open(session.store.create().id)


def _delete(session, client, rid):
    session.store.delete(session.conversation_id)
    session.close_conversation()


ENDINGS = [
    # how the reply ends, the reason it records, what is stored (text, finish_reason) or None
    pytest.param(_finish("eos"), FinishReason.EOS, ("Hello", "eos"), id="finished-eos"),
    pytest.param(_finish("stop"), FinishReason.STOP, ("Hello", "stop"), id="finished-stop"),
    pytest.param(_finish("length"), FinishReason.LENGTH, ("Hello", "length"), id="finished-length"),
    pytest.param(_stop, FinishReason.CANCELLED, ("Hel", "cancelled"), id="cancelled"),
    pytest.param(
        lambda session, client, rid: client.sig_reply.emit(Error(rid, "internal", "Out of memory.")),
        FinishReason.ERROR,
        ("Hel", "interrupted"),
        id="error",
    ),
    pytest.param(
        lambda session, client, rid: client.sig_reply.emit(WorkerCrashed(rid, "The engine stopped.")),
        FinishReason.CRASHED,
        ("Hel", "interrupted"),
        id="worker-crashed",
    ),
    pytest.param(
        lambda session, client, rid: session.abandon_reply("The engine was restarted."),
        FinishReason.ABANDONED,
        ("Hel", "interrupted"),
        id="engine-restarted",
    ),
    pytest.param(_open_another, FinishReason.ABANDONED, ("Hel", "interrupted"), id="another-conversation"),
    pytest.param(_delete, FinishReason.DISCARDED, None, id="conversation-deleted"),
]


@pytest.mark.parametrize(("end", "reason", "stored"), ENDINGS)
def test_every_ending_records_its_reason_and_ends_the_reply_once(
    session, client, store, ended, end, reason, stored
):
    session.send("Hi")
    conversation_id = session.conversation_id
    assert session.busy and session.reply.reason is None and client.generated
    rid = session.reply.request_id
    client.sig_reply.emit(ReplyText(rid, "Hel", 1))

    end(session, client, rid)

    assert [reply.reason for reply in ended] == [reason], "exactly one end signal, with its reason"
    reply = ended[0]
    assert reply.request_id == rid and not session.busy
    assert session.view.send_button.text() == "Send"
    if stored is None:
        assert reply.message is None
    else:
        text, finish_reason = stored
        last = store.get(conversation_id).messages[-1]
        assert last == reply.message and last.role == "assistant"
        assert (last.content, last.stats["finish_reason"]) == (text, finish_reason)
        if reply.finished is None:  # an end the engine did not give: what streamed, and why it stopped
            assert reply.error and last.stats["error"] == reply.error

    client.sig_reply.emit(_finished(rid, "cancelled"))  # a late end of the same reply changes nothing
    client.sig_reply.emit(WorkerCrashed(rid, "gone"))
    assert len(ended) == 1


def test_an_ending_with_nothing_streamed_stores_nothing_but_a_crash(session, client, store, ended):
    session.send("Hi")
    client.sig_reply.emit(Error(session.reply.request_id, "internal", "Out of memory."))
    assert ended[0].reason is FinishReason.ERROR and ended[0].message is None
    assert [m.role for m in store.get(session.conversation_id).messages] == ["user"]

    session.regenerate()
    client.sig_reply.emit(WorkerCrashed(session.reply.request_id, "The engine stopped."))
    assert ended[1].reason is FinishReason.CRASHED
    crash = store.get(session.conversation_id).messages[-1]
    assert crash == ended[1].message and crash.content == ""
    assert crash.stats == {"finish_reason": "interrupted", "error": "The engine stopped."}


def _shown(view) -> list[tuple[str, str, str]]:
    """Each bubble of the view: its kind, its text, its footer (the stats line, or the error line)."""
    shown = []
    for bubble in view._bubbles:
        if isinstance(bubble, UserBubble):
            shown.append(("user", bubble.message.content, ""))
        else:
            footer = bubble.error.text() if bubble.error is not None else bubble.stats.text()
            shown.append(("reply", bubble.text, footer))
    return shown


@pytest.mark.parametrize("streamed", ["", "A cow sa"], ids=["nothing-streamed", "text-streamed"])
def test_a_crashed_reply_stays_its_own_entry_apart_from_the_regenerated_one(
    session, client, store, ended, streamed
):
    session.send("What sound does a cow make?")
    if streamed:
        client.sig_reply.emit(ReplyText("reply-1", streamed, 2))
    client.sig_reply.emit(WorkerCrashed("reply-1", "The engine process stopped unexpectedly (signal 9)."))
    assert _shown(session.view)[-1] == (
        "reply",
        streamed,
        "⚠ The engine process stopped unexpectedly (signal 9).",
    )

    session.view.set_input_enabled(True)  # the restarted worker loaded the model
    session.regenerate()
    assert [m.role for m in client.generated[1]] == ["user"], "the model is not shown the interrupted reply"
    client.sig_reply.emit(ReplyText("reply-2", "A cow says moo.", 5))
    client.sig_reply.emit(_finished("reply-2", "eos", "A cow says moo."))

    stored = store.get(session.conversation_id).messages
    assert [(m.role, m.content, (m.stats or {}).get("finish_reason")) for m in stored] == [
        ("user", "What sound does a cow make?", None),
        ("assistant", streamed, "interrupted"),
        ("assistant", "A cow says moo.", "eos"),
    ]
    assert _shown(session.view) == [
        ("user", "What sound does a cow make?", ""),
        # its own bubble, its own line saying so and why
        ("reply", streamed, "interrupted: The engine process stopped unexpectedly (signal 9)."),
        ("reply", "A cow says moo.", "2 tokens"),
    ]
    session.view.set_input_enabled(True)
    session.send("And a dog?")  # answered now: the interrupted reply stays out of the context
    assert [m.content for m in client.generated[2]] == [
        "What sound does a cow make?",
        "A cow says moo.",
        "And a dog?",
    ]


def test_events_of_another_reply_are_ignored(session, client, ended):
    session.send("Hi")
    client.sig_reply.emit(ReplyText("reply-0", "stale", 1))
    client.sig_reply.emit(_finished("reply-0", "eos"))
    assert session.busy and not ended and session.reply.streamed == []


def test_the_window_shows_a_retry_banner_for_an_error_ending_only(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    window = MainWindow()  # its client is never started: the test plays the engine's part
    qtbot.addWidget(window)

    window.session.send("Hi")
    window.client.sig_reply.emit(WorkerCrashed(window.session.reply.request_id, "The engine stopped."))
    assert not [b for b in window.banners.banners() if b.key == "reply"]

    window.session.send("Hi again")
    window.client.sig_reply.emit(Error(window.session.reply.request_id, "internal", "Out of memory."))
    banners = [b for b in window.banners.banners() if b.key == "reply"]
    assert [b.message for b in banners] == ["Out of memory."]
    assert [button.text() for button in banners[0].action_buttons] == ["Retry"]
    window.close()


def _answer(session, client, text: str, prompt_tokens: int) -> None:
    stats = {"prompt_tokens": prompt_tokens, "generated_tokens": 5}
    client.sig_reply.emit(Finished(session.reply.request_id, "eos", text, "", prompt_tokens, 5, stats))


def test_a_full_context_window_drops_the_oldest_turns_from_what_is_sent_not_from_the_chat(
    session, client, store, ended
):
    for n in range(4):
        session.send(f"Question {n}")
        _answer(session, client, f"Answer {n}", prompt_tokens=100 * (n + 1))
    assert session.context_use() == 405
    session.send("Question 4")
    client.sig_reply.emit(Error(session.reply.request_id, "context_length_exceeded", "Too long."))
    assert ended[-1].error_kind == "context_length_exceeded"

    assert session.droppable_turns() == 4
    session.drop_oldest_turns()  # five turns: the oldest two are left out, and the last is asked again
    sent = [m.content for m in client.generated[-1]]
    assert sent == ["Question 2", "Answer 2", "Question 3", "Answer 3", "Question 4"]
    assert len(store.get(session.conversation_id).messages) == 9  # nothing deleted
    _answer(session, client, "Answer 4", prompt_tokens=200)
    session.send("Question 5")  # later turns keep the shorter context
    assert client.generated[-1][0].content == "Question 2"


def test_the_context_line_says_what_the_window_holds():
    from app.gui.chat.chat_session import context_text

    assert context_text(None, 1024) == ""
    assert context_text(1234, 32768) == "Context 1,234 / 32,768 tokens"
    assert context_text(12, None) == "Context 12 tokens"


def test_a_single_message_too_long_for_the_context_has_no_older_turns_to_drop(session, client, ended):
    session.send("A very long question")
    client.sig_reply.emit(Error(session.reply.request_id, "context_length_exceeded", "Too long."))
    assert ended[-1].error_kind == "context_length_exceeded" and session.droppable_turns() == 0
