"""sampling_from and ChatSettingsDialog: defaults, validation with the engine's own messages, values()."""

import pytest
from PySide6.QtWidgets import QDialogButtonBox

from app.gui.chat.chat_settings import (
    DEFAULT_MAX_NEW_TOKENS,
    SETTING_KEYS,
    ChatSettingsDialog,
    default_settings,
    sampling_from,
    template_kwargs_from,
)
from engine.errors import InvalidRequestError
from engine.generation_config import SamplingConfig


def test_sampling_from_fills_missing_keys_with_defaults():
    sampling, max_new_tokens = sampling_from({})
    assert sampling == SamplingConfig() and max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    sampling, max_new_tokens = sampling_from({"temperature": 0, "seed": 7, "max_new_tokens": 64, "x": 1})
    assert sampling.is_greedy and sampling.seed == 7 and max_new_tokens == 64
    assert set(default_settings()) == set(SETTING_KEYS)


@pytest.mark.parametrize(
    ("settings", "kwargs"),
    [
        ({}, {}),
        ({"think": True, "reasoning_effort": None}, {}),
        ({"think": False}, {"enable_thinking": False}),
        ({"reasoning_effort": "low"}, {"reasoning_effort": "low"}),
        (
            {"think": False, "reasoning_effort": "high"},
            {"enable_thinking": False, "reasoning_effort": "high"},
        ),
        ({"reasoning_effort": "maximal"}, {}),  # a hand-edited store: the template's default
    ],
)
def test_the_chat_template_gets_thinking_and_reasoning_effort(settings, kwargs):
    assert template_kwargs_from(settings) == kwargs


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"top_p": 0.0}, "top_p must be in"),
        ({"temperature": -1}, "temperature must be"),
        ({"seed": "abc"}, "seed must be an integer"),
        ({"max_new_tokens": 0}, "max_new_tokens must be"),
        ({"max_new_tokens": True}, "max_new_tokens must be"),
    ],
)
def test_sampling_from_refuses_what_the_engine_would(settings, message):
    with pytest.raises(InvalidRequestError, match=message):
        sampling_from(settings)


@pytest.mark.gui
def test_the_dialog_shows_and_returns_the_settings(qtbot):
    settings = {"temperature": 0.3, "top_p": 0.9, "top_k": 40, "max_new_tokens": 300, "seed": 11}
    dialog = ChatSettingsDialog("Be brief.", settings)
    qtbot.addWidget(dialog)
    prompt, values = dialog.values()
    assert prompt == "Be brief."
    assert values == settings | {"repetition_penalty": 1.0, "reasoning_effort": None}
    assert sampling_from(values)[0].seed == 11
    dialog.use_seed.setChecked(False)
    dialog.reasoning_effort.setCurrentIndex(dialog.reasoning_effort.findData("high"))
    dialog.system_prompt.setPlainText("  Answer in French.  ")
    changed = {"repetition_penalty": 1.0, "seed": None, "reasoning_effort": "high"}
    assert dialog.values() == ("Answer in French.", settings | changed)
    reopened = ChatSettingsDialog("", dialog.settings())
    qtbot.addWidget(reopened)
    assert reopened.reasoning_effort.currentText() == "High"


@pytest.mark.gui
def test_an_invalid_value_shows_the_engine_message_and_blocks_ok(qtbot):
    dialog = ChatSettingsDialog()
    qtbot.addWidget(dialog)
    ok = dialog.buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert ok.isEnabled() and dialog.error.isHidden()
    dialog.top_p.setValue(0.0)
    assert not ok.isEnabled() and not dialog.error.isHidden()
    assert "top_p must be in (0, 1]" in dialog.error.text()
    dialog.accept()
    assert dialog.result() == 0, "accept() refuses invalid settings"
    dialog.top_p.setValue(0.5)
    assert ok.isEnabled() and dialog.error.text() == ""


@pytest.mark.gui
def test_restore_defaults_and_unreadable_stored_values(qtbot):
    dialog = ChatSettingsDialog("", {"temperature": "hot", "top_k": None, "seed": 3})
    qtbot.addWidget(dialog)
    assert dialog.settings()["temperature"] == default_settings()["temperature"]
    assert dialog.settings()["seed"] == 3
    dialog.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults).click()
    assert dialog.settings() == default_settings()
