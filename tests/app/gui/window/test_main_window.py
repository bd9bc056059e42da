"""The whole app offscreen with a real worker on the demo model: chat, stop, regenerate, restart."""

import os
import subprocess
import sys
import time
from dataclasses import replace

import pytest
from PySide6.QtCore import QElapsedTimer, QTimer

from app.gui.chat.chat_session import FinishReason
from app.gui.engine.engine_client import ReplyText
from app.gui.window.main_window import MainWindow
from app.settings import AppSettings, SettingsStore
from app.storage import ConversationStore
from tests.screenshots import save_screenshot

pytestmark = [pytest.mark.gui, pytest.mark.slow]

START_MS = 90_000
GREEDY = {"temperature": 0.0, "max_new_tokens": 64}
LONG = {"temperature": 0.0, "max_new_tokens": 400}
STORY_PROMPTS = (
    tuple(
        f"Tell me a long story about {animal}."
        for animal in ("a cow", "a horse", "a sheep", "a pig", "a dog", "a cat")
    )
    * 2
)


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


CPU = AppSettings(device="cpu")


def open_window(qtbot, settings: AppSettings = CPU) -> MainWindow:
    window = MainWindow()
    qtbot.addWidget(window)
    window.settings = settings
    window.show()
    with qtbot.waitSignal(window.client.sig_loaded, timeout=START_MS):
        window.start_engine()
    return window


def send(qtbot, window: MainWindow, text: str, settings: dict) -> None:
    if window.session.conversation_id is None:
        window.new_conversation()
    window.store.set_settings(window.session.conversation_id, settings)
    window.chat_view.sig_send.emit(text)


def first_text(qtbot, window: MainWindow, timeout: int):
    """Wait for a reply's first streamed text."""
    return qtbot.waitSignal(
        window.client.sig_reply, timeout=timeout, check_params_cb=lambda e: isinstance(e, ReplyText)
    )


def reply_end(qtbot, window: MainWindow, timeout: int):
    """Wait for the end of a reply; `.args[0]` is the session's `Reply`."""
    return qtbot.waitSignal(window.session.sig_reply_ended, timeout=timeout)


def test_a_message_gets_a_streamed_reply_that_is_stored(qtbot, dirs):
    window = open_window(qtbot)
    chunks = []
    window.client.sig_reply.connect(lambda e: chunks.append(e.text) if isinstance(e, ReplyText) else None)
    with reply_end(qtbot, window, 60_000) as done:
        send(qtbot, window, "What sound does a cow make?", GREEDY)
    reply = done.args[0]
    assert reply.finished.text == "A cow says moo." and reply.reason.value == reply.finished.reason
    assert chunks, "the reply streamed in pieces"
    messages = window.session.conversation().messages
    assert [m.role for m in messages] == ["user", "assistant"]
    assert messages[1].content == "A cow says moo." and messages[1].stats["generated_tokens"] > 0
    window.close()


def test_stop_keeps_the_partial_reply_and_regenerate_replaces_it(qtbot, dirs, tmp_path):
    # plain decoding over a slow simulated link with a quarter of the experts cached: a few tokens/s,
    # so the story is still streaming when Stop is pressed (speculation would finish it in ~1 s)
    slow = AppSettings(
        device="cpu", expert_budget="24", sim_link_gbps=0.02, spec_mode="none", prefetch="none"
    )
    window = open_window(qtbot, slow)
    with first_text(qtbot, window, 60_000):
        send(qtbot, window, "Tell me a long story about a cow.", LONG)
    qtbot.wait(2000)  # streaming re-renders and a few Stats on the dashboard
    save_screenshot(window, "main_window_mid_reply.png", tmp_path)
    assert window.session.busy, "the reply ended before Stop: the test needs a slower reply"
    with reply_end(qtbot, window, 10_000) as done:
        window.chat_view.sig_stop.emit()
    assert done.args[0].finished.reason == "cancelled" and done.args[0].reason is FinishReason.CANCELLED
    stored = window.session.conversation().messages
    assert stored[-1].role == "assistant" and stored[-1].stats["finish_reason"] == "cancelled"

    window.store.set_settings(window.session.conversation_id, GREEDY)
    with reply_end(qtbot, window, 60_000) as again:
        window.chat_view.sig_regenerate.emit()
    messages = window.session.conversation().messages
    assert [m.role for m in messages] == ["user", "assistant"]
    finished = again.args[0].finished
    assert messages[-1].content == finished.text and finished.reason in ("eos", "length")
    window.close()


def test_conversations_and_settings_survive_a_restart_of_the_app(qtbot, dirs):
    window = open_window(qtbot)
    with reply_end(qtbot, window, 60_000):
        send(qtbot, window, "What sound does a cow make?", GREEDY)
    conversation_id = window.session.conversation_id
    window.apply_settings(AppSettings(device="cpu", policy="lfu", draft_len=6))
    window.close()

    store = ConversationStore()
    assert [m.content for m in store.get(conversation_id).messages][-1] == "A cow says moo."
    store.close()
    assert SettingsStore().load() == AppSettings(device="cpu", policy="lfu", draft_len=6)
    reopened = MainWindow()
    qtbot.addWidget(reopened)
    assert reopened.session.conversation_id == conversation_id
    reopened.close()


def test_the_event_loop_never_stalls_100_ms_while_a_reply_streams(qtbot, dirs):
    """Ticks of a 5 ms timer while replies stream: replies go on until at least 50 ticks are seen
    (the demo model answers a story in well under a second on a fast machine)."""
    window = open_window(qtbot)
    gaps, clock, timer = [], QElapsedTimer(), QTimer()
    timer.setInterval(5)
    timer.timeout.connect(lambda: gaps.append(clock.restart()))
    tokens = 0
    for prompt in STORY_PROMPTS:
        with first_text(qtbot, window, 60_000):
            send(qtbot, window, prompt, LONG)
        clock.start()
        timer.start()
        with reply_end(qtbot, window, 120_000) as done:
            pass
        timer.stop()
        tokens += done.args[0].finished.completion_tokens
        if len(gaps) > 50:
            break
    assert tokens > 30 and len(gaps) > 50
    print(f"longest event-loop gap while streaming: {max(gaps)} ms over {len(gaps)} ticks")
    assert max(gaps) < 100
    window.close()


def test_a_crashed_worker_shows_a_banner_restarts_and_keeps_the_conversation(qtbot, dirs):
    window = open_window(qtbot)
    with first_text(qtbot, window, 60_000):
        send(qtbot, window, "Tell me a long story about a cow.", LONG)
    ended = []
    window.session.sig_reply_ended.connect(ended.append)
    with qtbot.waitSignal(window.client.sig_loaded, timeout=START_MS):
        os.kill(window.client.ready.pid, 9)
    assert [reply.reason for reply in ended] == [FinishReason.CRASHED]
    assert any("stopped unexpectedly" in b.message for b in window.banners.banners())
    messages = window.session.conversation().messages
    assert messages[0].content == "Tell me a long story about a cow."
    assert messages[-1].role == "assistant" and messages[-1].stats["finish_reason"] == "interrupted"
    assert not window.session.busy
    window.close()


def test_the_window_opens_in_under_2_s_without_importing_torch(dirs):
    code = (
        "import sys, time\n"
        "t0 = time.perf_counter()\n"
        "from PySide6.QtWidgets import QApplication\n"
        "app = QApplication([])\n"
        "from app.gui.window.main_window import MainWindow\n"
        "w = MainWindow(); w.show(); app.processEvents()\n"
        "print(time.perf_counter() - t0, 'torch' in sys.modules)\n"
        "w.client.shutdown(); w.store.close()\n"
    )
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    seconds, torch_imported = out.stdout.split()
    total = time.perf_counter() - started
    print(f"window shown {float(seconds):.2f} s after start (process total {total:.2f} s)")
    assert torch_imported == "False"
    assert float(seconds) < 2.0


def test_the_model_picker_opens_from_the_window_and_keeps_one_download_manager(qtbot, dirs, monkeypatch):
    from app.gui.models import model_picker

    shown = []
    monkeypatch.setattr(model_picker.ModelPicker, "exec", lambda picker: shown.append(picker) or 0)
    window = MainWindow(client=None)
    qtbot.addWidget(window)
    window.open_model_picker()
    window.open_model_picker()
    assert len(shown) == 2 and shown[0].manager is shown[1].manager is window.downloads
    window.close()


def test_a_damaged_settings_file_gives_a_banner_and_defaults(qtbot, dirs):
    store = SettingsStore()
    store.path.parent.mkdir(parents=True, exist_ok=True)
    store.path.write_text('{"device": "quantum", "draft_len": 6}')
    window = MainWindow()
    qtbot.addWidget(window)
    assert window.settings.device == "auto" and window.settings.draft_len == 6
    assert any("reset" in b.message and "device" in b.message.lower() for b in window.banners.banners())
    window.close()


def test_the_tune_wizard_opens_for_a_loaded_model_and_its_result_is_applied(qtbot, dirs, monkeypatch):
    from app.gui.tune import tune_wizard

    shown = []
    monkeypatch.setattr(tune_wizard.TuneWizard, "exec", lambda wizard: shown.append(wizard) or 0)
    window = MainWindow()
    qtbot.addWidget(window)
    window.open_tune_wizard()
    assert not shown and any("Load a model" in b.message for b in window.banners.banners())
    window.model_info = {"model_type": "qwen3_moe"}  # as after sig_loaded
    window.open_tune_wizard()
    assert len(shown) == 1
    tuned = replace(window.settings.with_tune(), expert_budget="24")  # a budget typed in the wizard
    shown[0].sig_apply.emit(tuned)
    assert window.settings == tuned and SettingsStore().load() == tuned
    window.close()


def test_a_gguf_file_dropped_on_the_window_is_imported_under_its_name_and_opened(qtbot, dirs, monkeypatch):
    """Drop a GGUF file (as from a file manager): checked, registered by its own name, loaded; a
    folder of two GGUF models asks which one; what cannot be a model is not accepted."""
    from gguf import GGMLQuantizationType as QT
    from PySide6.QtCore import QMimeData, QPoint, Qt, QUrl
    from PySide6.QtGui import QDropEvent

    from app.gui.models import model_import
    from app.model_library import ModelLibrary
    from engine.tiny.gguf_writer import write_tiny_gguf

    folder = dirs / "ggufs"
    first = write_tiny_gguf(folder, expert_type=QT.Q4_K)
    second = write_tiny_gguf(folder, expert_type=QT.Q8_0, other_type=QT.Q8_0)
    window = MainWindow(client=None)
    qtbot.addWidget(window)
    used = []
    monkeypatch.setattr(window, "_use_model", used.append)

    def drop(path) -> QDropEvent:
        mime = QMimeData()
        mime.setUrls([QUrl.fromLocalFile(str(path))])
        event = QDropEvent(
            QPoint(5, 5),
            Qt.DropAction.CopyAction,
            mime,
            Qt.MouseButton.LeftButton,
            Qt.KeyboardModifier.NoModifier,
        )
        window.dropEvent(event)
        return event

    assert drop(first).isAccepted()
    qtbot.waitUntil(lambda: used == [str(first)], timeout=60_000)
    assert ModelLibrary().name_of(first) == "tiny-qwen3_moe-Q4_K (Q4_K_M)"
    asked = []
    monkeypatch.setattr(
        model_import, "choose_from_list", lambda parent, where, files: asked.append(files) or files[1]
    )
    drop(folder)
    qtbot.waitUntil(lambda: len(used) == 2, timeout=60_000)
    assert asked == [(first, second)] and used[1] == str(second)
    text = dirs / "notes.txt"
    text.write_text("not a model")
    assert not drop(text).isAccepted() and len(used) == 2
    window.close()
