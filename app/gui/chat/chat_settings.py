"""Per-chat system prompt and generation settings: the dialog and the pure conversion.

A conversation stores its settings as a plain dict (JSON in the store) with the
keys in `SETTING_KEYS`; `sampling_from(settings)` turns it into the engine's
`SamplingConfig` and a max-new-tokens count, filling missing keys with the
defaults and raising `InvalidRequestError` (the engine's own message) for a
value out of range. `ChatSettingsDialog` edits both and validates as the user
types with the same `SamplingConfig.validate()`, so the dialog can never store
what the engine would refuse.
"""

from __future__ import annotations

from typing import Any

from PySide6.QtCore import QSize
from PySide6.QtGui import QPalette
from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QGridLayout,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.gui.widgets.window_state import available_geometry, fit_to_screen
from engine.errors import InvalidRequestError
from engine.generation_config import SamplingConfig

DEFAULT_MAX_NEW_TOKENS = 1024
MAX_NEW_TOKENS_LIMIT = 32768
SETTING_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "max_new_tokens",
    "repetition_penalty",
    "seed",
    "reasoning_effort",
)
# gpt-oss's harmony templates read `reasoning_effort`; other templates ignore it (as in the server)
REASONING_EFFORTS = ("low", "medium", "high")
_HELP = {
    "temperature": "Randomness. 0 always picks the most likely token (greedy); 0.7 is a usual chat value.",
    "top_p": "Sample only from the most likely tokens that together hold this much probability. 1 = off.",
    "top_k": "Sample only from the k most likely tokens. 0 = off.",
    "max_new_tokens": "The reply stops after this many tokens.",
    "repetition_penalty": "Above 1 discourages repeating tokens already in the chat. 1 = off.",
    "seed": "A fixed seed makes sampling repeatable; off draws a new one each time.",
    "reasoning_effort": "How long a reasoning model (gpt-oss) thinks before answering. Others ignore it.",
}


def default_settings() -> dict[str, Any]:
    """The settings of a new chat, with every key of `SETTING_KEYS`."""
    sampling = SamplingConfig()
    return {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
        "repetition_penalty": sampling.repetition_penalty,
        "seed": sampling.seed,
        "reasoning_effort": None,  # the template's own default
    }


def sampling_from(settings: dict) -> tuple[SamplingConfig, int]:
    """The validated sampling config and max new tokens of a chat's settings (missing keys: defaults)."""
    merged = default_settings() | {key: settings[key] for key in SETTING_KEYS if key in settings}
    max_new_tokens = merged["max_new_tokens"]
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InvalidRequestError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    sampling = SamplingConfig(
        temperature=merged["temperature"],
        top_p=merged["top_p"],
        top_k=merged["top_k"],
        repetition_penalty=merged["repetition_penalty"],
        seed=merged["seed"],
    )
    sampling.validate()
    return sampling, max_new_tokens


def template_kwargs_from(settings: dict) -> dict[str, bool | str]:
    """What a chat's settings pass to the chat template: thinking switched off (Qwen3's
    `enable_thinking`) and a reasoning effort (gpt-oss); nothing for the template's own defaults."""
    kwargs: dict[str, bool | str] = {"enable_thinking": False} if settings.get("think") is False else {}
    if settings.get("reasoning_effort") in REASONING_EFFORTS:  # a hand-edited store's other value: ignored
        kwargs["reasoning_effort"] = settings["reasoning_effort"]
    return kwargs


def _double(minimum: float, maximum: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    box = QDoubleSpinBox(minimum=minimum, maximum=maximum, singleStep=step, decimals=decimals)
    box.setKeyboardTracking(True)
    return box


class ChatSettingsDialog(QDialog):
    """Edit one chat's system prompt and sampling settings; OK only while they are valid."""

    def __init__(self, system_prompt: str = "", settings: dict | None = None, parent: QWidget | None = None):
        super().__init__(parent)
        self.setWindowTitle("Chat settings")
        self.system_prompt = QPlainTextEdit(objectName="systemPrompt")
        self.system_prompt.setPlaceholderText("Optional instructions the model sees before the conversation.")
        self.system_prompt.setPlainText(system_prompt)
        self.system_prompt.setMinimumHeight(80)
        # The ranges are wide on purpose: validate() judges the values and says why one is wrong.
        self.temperature = _double(0.0, 5.0, 0.05)
        self.top_p = _double(0.0, 1.0, 0.05)
        self.top_k = QSpinBox(minimum=0, maximum=100_000)
        self.max_new_tokens = QSpinBox(minimum=1, maximum=MAX_NEW_TOKENS_LIMIT, singleStep=64)
        self.repetition_penalty = _double(0.0, 5.0, 0.05)
        self.use_seed = QCheckBox("Fixed")
        self.seed = QSpinBox(minimum=0, maximum=2**31 - 1)
        self.use_seed.toggled.connect(self.seed.setEnabled)
        self.reasoning_effort = QComboBox(objectName="reasoningEffort")
        self.reasoning_effort.addItem("Model default", None)
        for effort in REASONING_EFFORTS:
            self.reasoning_effort.addItem(effort.capitalize(), effort)
        self.error = QLabel(objectName="settingsError", wordWrap=True)
        self.error.setStyleSheet("color: #d32f2f;")
        self.buttons = QDialogButtonBox(
            QDialogButtonBox.StandardButton.Ok
            | QDialogButtonBox.StandardButton.Cancel
            | QDialogButtonBox.StandardButton.RestoreDefaults
        )
        self.buttons.accepted.connect(self.accept)
        self.buttons.rejected.connect(self.reject)
        restore = self.buttons.button(QDialogButtonBox.StandardButton.RestoreDefaults)
        restore.clicked.connect(lambda: self._load(default_settings()))
        self._lay_out()
        self._load(default_settings() | (settings or {}))
        for box in (self.temperature, self.top_p, self.top_k, self.max_new_tokens, self.repetition_penalty):
            box.valueChanged.connect(self._validate)
        self.use_seed.toggled.connect(self._validate)
        self._validate()

    def _lay_out(self) -> None:
        grid = QGridLayout()  # label | field | what it does
        grid.setColumnStretch(2, 1)
        grid.setHorizontalSpacing(12)
        seed = QHBoxLayout()
        seed.addWidget(self.use_seed)
        seed.addWidget(self.seed, 1)
        rows = (
            ("Temperature", self.temperature, "temperature"),
            ("Top-p", self.top_p, "top_p"),
            ("Top-k", self.top_k, "top_k"),
            ("Max new tokens", self.max_new_tokens, "max_new_tokens"),
            ("Repetition penalty", self.repetition_penalty, "repetition_penalty"),
            ("Seed", seed, "seed"),
            ("Reasoning effort", self.reasoning_effort, "reasoning_effort"),
        )
        for row, (label, field, key) in enumerate(rows):
            grid.addWidget(QLabel(label), row, 0)
            if isinstance(field, QHBoxLayout):
                grid.addLayout(field, row, 1)
            else:
                field.setMinimumWidth(130)
                grid.addWidget(field, row, 1)
            hint = QLabel(_HELP[key], wordWrap=True)
            hint.setForegroundRole(QPalette.ColorRole.PlaceholderText)
            grid.addWidget(hint, row, 2)
        layout = QVBoxLayout(self)
        layout.addWidget(QLabel("System prompt"))
        layout.addWidget(self.system_prompt, 1)
        layout.addSpacing(6)
        layout.addLayout(grid)
        layout.addWidget(self.error)
        layout.addWidget(self.buttons)
        fit_to_screen(self, QSize(640, self.sizeHint().height()), available_geometry(self.parentWidget()))

    def _load(self, settings: dict) -> None:
        defaults = default_settings()

        def value(key: str, kind: type) -> Any:
            try:
                return kind(settings[key])
            except (KeyError, TypeError, ValueError):  # a hand-edited store: show the default
                return defaults[key]

        self.temperature.setValue(value("temperature", float))
        self.top_p.setValue(value("top_p", float))
        self.top_k.setValue(value("top_k", int))
        self.max_new_tokens.setValue(value("max_new_tokens", int))
        self.repetition_penalty.setValue(value("repetition_penalty", float))
        seed = settings.get("seed")
        self.use_seed.setChecked(isinstance(seed, int))
        self.seed.setEnabled(isinstance(seed, int))
        if isinstance(seed, int):
            self.seed.setValue(seed)
        effort = settings.get("reasoning_effort")
        self.reasoning_effort.setCurrentIndex(max(0, self.reasoning_effort.findData(effort)))

    def settings(self) -> dict[str, Any]:
        """The settings as shown (not validated)."""
        return {
            "temperature": round(self.temperature.value(), 4),
            "top_p": round(self.top_p.value(), 4),
            "top_k": self.top_k.value(),
            "max_new_tokens": self.max_new_tokens.value(),
            "repetition_penalty": round(self.repetition_penalty.value(), 4),
            "seed": self.seed.value() if self.use_seed.isChecked() else None,
            "reasoning_effort": self.reasoning_effort.currentData(),
        }

    def error_text(self) -> str:
        """Why the settings are refused, or '' when they are valid."""
        try:
            sampling_from(self.settings())
        except InvalidRequestError as exc:
            return str(exc)
        return ""

    def _validate(self) -> None:
        message = self.error_text()
        self.error.setText(message)
        self.error.setVisible(bool(message))
        self.buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(not message)

    def accept(self) -> None:
        if not self.error_text():
            super().accept()

    def values(self) -> tuple[str, dict]:
        """The system prompt and the settings dict (keys: `SETTING_KEYS`)."""
        return self.system_prompt.toPlainText().strip(), self.settings()
