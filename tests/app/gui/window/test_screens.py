"""Any screen: the main window and the dialogs fit 1024×600 to 1920×1080, the input and Send stay in
view, bubbles wrap in a narrow column, and the window's geometry and splitter sizes are remembered.

The window's client is never started: the tests play the engine's part (a `Loaded` model dict,
`Stats`), so no worker runs. Each size is shown as if it were the screen's free area.
"""

import pytest
from PySide6.QtCore import QRect

import app.gui.settings.settings_dialog as settings_dialog_module
import app.gui.window.main_window as main_window_module
from app.gui.chat.chat_settings import ChatSettingsDialog
from app.gui.chat.chat_view import ChatView
from app.gui.engine.engine_state import SIMULATED_LINK
from app.gui.settings.settings_dialog import SettingsDialog
from app.gui.window.main_window import MainWindow
from app.settings import AppSettings
from app.storage import Conversation, StoredMessage
from engine.resources import demo_model_dir
from tests.app.gui.screens import assert_fully_shown, rect_in
from tests.screenshots import save_screenshot

pytestmark = pytest.mark.gui

SCREENS = [(1024, 600), (1280, 800), (1920, 1080)]
MODEL = {
    "path": str(demo_model_dir()),
    "model_type": "qwen3_moe",
    "moe_layers": 2,
    "num_experts": 8,
    "top_k": 2,
    "cache_slots": 8,
    "device": "cpu",
    "simulated_link": True,
}
QUESTION = "Explain how speculative decoding works with an offloaded MoE model, in a few lines."
ANSWER = (
    "Speculative decoding drafts several tokens cheaply and verifies them in **one pass** of the big "
    "model.\n\n```python\ndef speculative_decode(draft, target, tokens, draft_len=4):\n"
    "    proposal = draft.generate(tokens, draft_len)\n    return target.verify(tokens, proposal)\n```\n\n"
    "While the draft runs, the experts verification will need are copied to the GPU."
)
LONG_WORD = "https://huggingface.co/Qwen/Qwen3-30B-A3B-Instruct-2507/resolve/main/model-00001-of-00016"
REPLY_STATS = {"generated_tokens": 64, "tokens_per_s": 12.3, "accept_len": 2.8, "simulated_link": True}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path


def as_screen(monkeypatch, width: int, height: int) -> QRect:
    """Make (0, 0, width, height) the screen's free area for the window and its dialogs."""
    available = QRect(0, 0, width, height)
    for module in (main_window_module, settings_dialog_module):
        monkeypatch.setattr(module, "available_geometry", lambda widget=None: available)
    return available


def open_window(qtbot, chat: bool = True) -> MainWindow:
    """A window showing a loaded model (no worker) and, with `chat`, a conversation ending in a reply."""
    window = MainWindow()
    qtbot.addWidget(window)
    if chat:
        conversation = window.store.create()
        window.store.add_message(conversation.id, "user", f"{QUESTION} {LONG_WORD}")
        window.store.add_message(conversation.id, "assistant", ANSWER, REPLY_STATS | {"finish_reason": "eos"})
        window.session.open(conversation.id)
        window.conversations.refresh()
        window.conversations.select(conversation.id)
    window.show()
    qtbot.waitExposed(window)
    window._load_id = "load-1"
    window.client.sig_loaded.emit("load-1", MODEL)
    qtbot.wait(150)  # layouts settle, the scroll area follows the bottom
    return window


def last_reply(window: MainWindow):
    return window.chat_view._bubbles[-1]


@pytest.mark.parametrize(("width", "height"), SCREENS)
def test_the_window_fits_the_screen_and_keeps_the_input_in_view(
    qtbot, dirs, monkeypatch, tmp_path, width, height
):
    available = as_screen(monkeypatch, width, height)
    window = open_window(qtbot)
    assert window.frameGeometry().width() <= width and window.frameGeometry().height() <= height
    assert available.contains(window.frameGeometry()), window.frameGeometry()
    if (width, height) != (1920, 1080):
        assert window.width() >= width - 10 and window.height() >= height - 40  # the screen is used
    assert window.dashboard_dock.isVisible()
    view = window.chat_view
    for widget in (view.input, view.send_button):
        assert_fully_shown(widget, window)
    reply = last_reply(window)
    for widget in (reply.copy_button, reply.regenerate_button, window.chat_view._bubbles[0].edit_button):
        assert_fully_shown(widget, window)
    page = view._scroll.widget()
    assert page.width() <= view._scroll.viewport().width(), "the chat page is wider than its column"
    assert SIMULATED_LINK in window.engine_label.text()
    assert window.engine_label.text() == window.dashboard.status.text()
    save_screenshot(window, f"main-window-{width}x{height}.png", tmp_path)


def test_a_window_taller_than_the_dashboard_is_never_needed(qtbot, dirs, monkeypatch):
    as_screen(monkeypatch, 1024, 600)
    window = open_window(qtbot, chat=False)
    assert window.minimumSizeHint().height() <= 600 - 40  # the dashboard scrolls inside its dock
    assert window.minimumSizeHint().width() <= 1024


def test_bubbles_wrap_and_keep_their_buttons_in_a_narrow_column(qtbot, tmp_path):
    view = ChatView()
    qtbot.addWidget(view)
    view.resize(380, 560)
    view.show()
    qtbot.waitExposed(view)
    messages = (
        StoredMessage(1, "user", f"{QUESTION} {LONG_WORD}", None, 0.0),
        StoredMessage(2, "assistant", ANSWER, REPLY_STATS | {"finish_reason": "length"}, 0.0),
    )
    view.set_conversation(Conversation(1, "t", "", {}, messages, 0.0))
    qtbot.wait(150)
    page = view._scroll.widget()
    assert page.width() <= view._scroll.viewport().width()
    user, reply = view._bubbles
    for widget in (user.edit_button, reply.copy_button, reply.regenerate_button, reply.stats):
        assert_fully_shown(widget, view)
    assert user.body.text() == f"{QUESTION} {LONG_WORD}"  # the text as written: breaks are display only
    assert rect_in(user.card, page).right() <= page.width()
    save_screenshot(view, "chat-narrow-column.png", tmp_path)


def test_geometry_and_splitter_sizes_are_remembered(qtbot, dirs, monkeypatch):
    as_screen(monkeypatch, 1920, 1080)
    window = open_window(qtbot, chat=False)
    window.resize(760, 560)  # within the offscreen platform's own 800×800 screen: Qt keeps it as is
    window.splitter.setSizes([150, 300])
    qtbot.wait(50)
    sizes = window.splitter.sizes()
    window.close()
    again = open_window(qtbot, chat=False)
    assert (again.width(), again.height()) == (760, 560)
    assert again.splitter.sizes() == sizes
    assert (dirs / "config" / "window.ini").is_file()  # beside the settings: the tests' own folder


def test_a_geometry_saved_on_a_larger_screen_is_fitted_to_a_smaller_one(qtbot, dirs, monkeypatch):
    as_screen(monkeypatch, 1920, 1080)
    window = open_window(qtbot, chat=False)
    window.resize(1800, 1000)
    window.close()
    available = as_screen(monkeypatch, 1024, 600)
    again = open_window(qtbot, chat=False)
    assert available.contains(again.frameGeometry()), again.frameGeometry()
    assert_fully_shown(again.chat_view.send_button, again)


def test_the_settings_dialog_fits_a_small_screen_and_its_note_overlaps_nothing(qtbot, monkeypatch, tmp_path):
    available = as_screen(monkeypatch, 1024, 600)
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    dialog._editors["device"].combo.setCurrentIndex(1)  # a reload field changed: the note shows
    qtbot.wait(50)
    assert dialog.reload_note.text() == "Applying loads the model again."
    assert available.contains(dialog.frameGeometry()), dialog.frameGeometry()
    note = rect_in(dialog.reload_note, dialog)
    for button in dialog.button_box.buttons():
        assert_fully_shown(button, dialog)
        assert not note.intersects(rect_in(button, dialog)), button.text()
    assert_fully_shown(dialog.tune_button, dialog)
    save_screenshot(dialog, "settings-1024x600.png", tmp_path)


def test_the_simulated_link_reads_the_same_in_settings(qtbot):
    dialog = SettingsDialog(AppSettings())
    qtbot.addWidget(dialog)
    editor = dialog._editors["sim_link_gbps"]
    # no speed set: nothing is simulated, the CPU uses the experts in place (no banner either)
    assert editor.spin.text() == "none (in place)"
    assert SIMULATED_LINK in dialog._help["sim_link_gbps"].text()


def test_the_chat_settings_dialog_fits_its_screen(qtbot, monkeypatch):
    available = QRect(0, 0, 1024, 600)
    monkeypatch.setattr("app.gui.chat.chat_settings.available_geometry", lambda widget=None: available)
    dialog = ChatSettingsDialog("Be brief.", {})
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    assert available.contains(dialog.frameGeometry())
    for button in dialog.buttons.buttons():
        assert_fully_shown(button, dialog)


def test_editing_the_first_message_retitles_the_chat(qtbot, dirs):
    window = open_window(qtbot)
    first = window.session.conversation().messages[0]
    window.chat_view.sig_edit_resend.emit(first.id, "What is an expert cache?")
    assert window.session.conversation().title == "What is an expert cache?"
    window.session.abandon_reply("test over")
    window.store.rename(window.session.conversation_id, "My own title")
    first = window.session.conversation().messages[0]
    window.chat_view.sig_edit_resend.emit(first.id, "And a prefetch?")
    assert window.session.conversation().title == "My own title"  # a title the user chose stays
