"""A failure shown in full: one sentence that wraps, its technical details behind "Details…".

`ErrorPanel` sits under a table (the model picker's), so a long sentence is never clipped in a
cell. `show_error(message, details)` shows it; Details… unfolds the details (selectable, to copy
into a bug report); × hides the panel. The same details are in the log file.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPlainTextEdit, QPushButton, QVBoxLayout, QWidget

ERROR_COLOUR = "#b3261e"
BACKGROUND = "#fbeae9"
DETAILS_LINES = 8


class ErrorPanel(QFrame):
    """One failure: its sentence, and its details behind a button (see the module docstring)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setObjectName("error_panel")
        self.setStyleSheet(
            f"#error_panel {{ background: {BACKGROUND}; border: 1px solid {ERROR_COLOUR}; "
            "border-radius: 4px; }"
        )
        self.message_label = QLabel()
        self.message_label.setWordWrap(True)
        self.message_label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.message_label.setStyleSheet(f"color: {ERROR_COLOUR};")
        self.details_button = QPushButton("Details…")
        self.details_button.setCheckable(True)
        self.details_button.toggled.connect(self._show_details)
        close_button = QPushButton("×")
        close_button.setToolTip("Hide this message")
        close_button.setFixedWidth(close_button.sizeHint().height())
        close_button.clicked.connect(self.clear)
        self.details_view = QPlainTextEdit()
        self.details_view.setReadOnly(True)
        self.details_view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        line = self.details_view.fontMetrics().lineSpacing()
        self.details_view.setFixedHeight(line * DETAILS_LINES + 12)
        self.details_view.hide()
        row = QHBoxLayout()
        row.addWidget(self.message_label, 1)
        row.addWidget(self.details_button, 0, Qt.AlignmentFlag.AlignTop)
        row.addWidget(close_button, 0, Qt.AlignmentFlag.AlignTop)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.addLayout(row)
        layout.addWidget(self.details_view)
        self.hide()

    def show_error(self, message: str, details: str = "") -> None:
        """Show `message` in full; Details… appears when there are `details`."""
        self.message_label.setText(message)
        self.message_label.setToolTip(message)
        self.details_view.setPlainText(details)
        self.details_button.setChecked(False)
        self.details_button.setVisible(bool(details))
        self.show()

    def clear(self) -> None:
        self.details_button.setChecked(False)
        self.hide()

    def message(self) -> str:
        """The sentence shown, or "" when the panel is hidden."""
        return self.message_label.text() if not self.isHidden() else ""

    def _show_details(self, shown: bool) -> None:
        self.details_view.setVisible(shown)
        self.details_button.setText("Hide details" if shown else "Details…")


def error_details(error: Exception) -> str:
    """The technical account of `error` for "Details…": a HubError's own, else its type and text."""
    failure = getattr(error, "failure", None)
    return failure.details if failure is not None else f"{type(error).__name__}: {error}"
