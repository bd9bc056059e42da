"""A thinking model in the window: its thinking streams into a collapsed panel above the reply and
is stored apart from the answer; the Think toggle (shown for such a model only) is kept per chat
and switches the template's thinking off."""

import pytest

from app.gui.chat.thinking import Thinking, thought_label
from app.settings import AppSettings
from tests.app.gui.window.test_main_window import dirs, open_window, reply_end, send  # noqa: F401 (fixture)
from tests.engine.thinking_model import save_thinking_model
from tests.screenshots import save_screenshot

pytestmark = [pytest.mark.gui, pytest.mark.slow]

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


def test_thinking_is_shown_collapsed_stored_apart_and_can_be_switched_off(qtbot, dirs, tmp_path):  # noqa: F811
    folder = save_thinking_model(tmp_path / "thinking")
    window = open_window(qtbot, AppSettings(device="cpu", model_path=str(folder)))
    view = window.chat_view
    assert view.think_button.isVisible() and view.think_button.isChecked()
    with reply_end(qtbot, window, 60_000) as done:
        send(qtbot, window, "Hi", GREEDY)
    reply = done.args[0].message
    assert reply.reasoning and reply.content == ""  # the prompt opened <think>; it never closed
    assert reply.stats["thinking_tokens"] > 0 and reply.stats["thinking_s"] >= 0
    bubble = view._bubbles[-1]
    panel = bubble.thinking
    assert panel.isVisible() and not panel.expanded and not panel.text.isVisible()
    assert panel.header.text().startswith("Thought for") and panel.text.text() == reply.reasoning.strip()
    panel.header.click()
    assert panel.text.isVisible()
    save_screenshot(window, "thinking-expanded.png", tmp_path)

    view.think_button.click()  # off for this chat: the template writes an empty block
    conversation = window.session.conversation()
    assert conversation.settings["think"] is False
    assert conversation.settings["temperature"] == 0.0  # the chat's other settings are kept
    with reply_end(qtbot, window, 60_000) as again:
        view.sig_send.emit("Hi again")
    second = again.args[0].message
    assert second.reasoning == "" and second.content and "thinking_tokens" not in second.stats
    assert view._bubbles[-1].thinking is None
    window.new_conversation()
    assert view.think_button.isChecked()  # a new chat thinks again
    window.session.open(conversation.id)
    assert not view.think_button.isChecked()
    window.close()


def test_a_model_that_does_not_think_shows_no_toggle(qtbot, dirs):  # noqa: F811
    window = open_window(qtbot, AppSettings(device="cpu"))
    assert not window.chat_view.think_button.isVisible()
    window.close()


def test_the_header_says_how_long_and_how_many_tokens():
    assert thought_label(3.21, 41) == "Thought for 3.2 s · 41 tokens"
    assert Thinking().label() == "" and Thinking().stats() == {}
