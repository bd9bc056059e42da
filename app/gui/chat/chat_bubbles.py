"""The pieces of the conversation pane: reply and user bubbles, their labels, the input box.

A bubble shows one `StoredMessage` and knows nothing of `ChatView`, the engine or
the store: its owner hands it the message (None for a reply still streaming), the
colours and the width to lay out at, and hears back only through the callbacks it
passed (`on_regenerate`; `on_resend(message_id, text)` after an in-place edit).
The owner decides when a bubble renders: `ReplyBubble.render` re-renders only the
markdown blocks whose source changed, so calling it often is cheap but never free;
throttling is the owner's job. The owner also shows or enables Regenerate / Edit.

`stats_line` is the small line under a finished reply. `InputBox` (Enter submits,
Shift+Enter starts a new line) serves both the pane's input and a bubble's editor;
`dim` and `discard` are the label and widget helpers the pane shares.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from PySide6.QtCore import QSize, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QGuiApplication, QKeyEvent, QPainter, QPaintEvent, QPalette, QResizeEvent
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.gui.chat.thinking import ThinkingPanel, stored_label
from app.markdown_render import render_markdown, split_blocks
from app.storage import StoredMessage

USER_INDENT_PX = 80  # user bubbles sit right, at least this far from the left edge
REPLY_MARGIN_PX = 4
_ENDINGS = {"cancelled": "stopped", "length": "token limit reached", "interrupted": "interrupted"}
_LONG_RUN = re.compile(r"\S{25,}")  # a "word" this long (a URL, a hash) would widen the whole page
BREAK_EVERY = 16
ZWSP = "\u200b"  # a zero-width space: where Qt may break a line


def breakable(text: str) -> str:
    """`text` with a line-break chance every `BREAK_EVERY` characters of a very long word, so a
    label wraps it in a narrow column instead of growing past it (QLabel wraps at spaces only)."""

    def split(match: re.Match) -> str:
        run = match.group(0)
        return ZWSP.join(run[i : i + BREAK_EVERY] for i in range(0, len(run), BREAK_EVERY))

    return _LONG_RUN.sub(split, text)


def stats_line(stats: dict | None) -> str:
    """The small line under a reply: tokens, tok/s, acceptance length (speculative), how it ended
    (an interrupted reply with why: "interrupted: The engine stopped.")."""
    stats = stats or {}
    parts = []
    if stats.get("generated_tokens") is not None:
        parts.append(f"{stats['generated_tokens']} tokens")
    if stats.get("tokens_per_s") is not None:
        parts.append(f"{stats['tokens_per_s']:.1f} tok/s")
    if stats.get("accept_len") is not None:
        parts.append(f"accept len {stats['accept_len']:.2f}")
    if stats.get("simulated_link"):
        parts.append("simulated link")
    ending = _ENDINGS.get(stats.get("finish_reason"))
    if ending is not None:
        parts.append(f"{ending}: {stats['error']}" if stats.get("error") else ending)
    return " · ".join(parts)


def discard(widget: QWidget) -> None:
    """Take a widget out of its page now (deleteLater alone leaves it shown until the next turn)."""
    widget.hide()
    widget.setParent(None)
    widget.deleteLater()


class InputBox(QPlainTextEdit):
    """A plain text box where Enter submits and Shift+Enter starts a new line."""

    sig_submit = Signal()
    """Enter was pressed without Shift."""

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter):
            if event.modifiers() & Qt.KeyboardModifier.ShiftModifier:
                self.insertPlainText("\n")  # a real newline, not Qt's soft line separator
            else:
                self.sig_submit.emit()
            return
        super().keyPressEvent(event)


def _tool_button(text: str, name: str, slot: Callable[[], None]) -> QToolButton:
    button = QToolButton(text=text, objectName=name, autoRaise=True)
    button.setCursor(Qt.CursorShape.PointingHandCursor)
    button.clicked.connect(slot)
    return button


def _selectable(label: QLabel) -> QLabel:
    label.setTextInteractionFlags(
        Qt.TextInteractionFlag.TextSelectableByMouse | Qt.TextInteractionFlag.LinksAccessibleByMouse
    )
    label.setOpenExternalLinks(True)
    label.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
    return label


def dim(label: QLabel, scale: float = 1.0) -> QLabel:
    """Grey (the palette's placeholder colour, so dark themes work) and optionally smaller."""
    label.setForegroundRole(QPalette.ColorRole.PlaceholderText)
    font = label.font()
    font.setPointSizeF(font.pointSizeF() * scale)
    label.setFont(font)
    return label


class _PlainLabel(QLabel):
    """Word-wrapped plain text that asks for its natural width (QLabel's own guess is narrow) and
    wraps a very long word too (`breakable`); `text()` is the text as given."""

    def __init__(self, text: str, **kwargs):
        super().__init__(**kwargs)
        self._plain = ""
        self.setText(text)

    def setText(self, text: str) -> None:
        self._plain = text
        super().setText(breakable(text))

    def text(self) -> str:
        return self._plain

    def sizeHint(self) -> QSize:
        hint = super().sizeHint()
        lines = self.text().splitlines() or [""]
        natural = max(self.fontMetrics().horizontalAdvance(line) for line in lines) + 4
        return QSize(max(hint.width(), natural), hint.height())


class _RichLabel(QLabel):
    """Rich text laid out once per width. QLabel's own size hints lay the document out again
    and again (~10 times a change: hundreds of ms for a long reply); here layouts get
    height-for-width only, remembered per width until the text changes."""

    def __init__(self, html: str, width: int):
        super().__init__(objectName="messageBody", textFormat=Qt.TextFormat.RichText, wordWrap=True)
        _selectable(self)
        self._width = width  # the width it will most likely get: layouts ask the hint's height too
        self._heights: dict[int, int] = {}
        self.setText(html)

    def setText(self, html: str) -> None:
        self._heights = {}
        super().setText(html)

    def heightForWidth(self, width: int) -> int:
        if width not in self._heights:
            if len(self._heights) > 8:  # a window being resized: keep only recent widths
                self._heights = {}
            self._heights[width] = super().heightForWidth(width)
        return self._heights[width]

    def resizeEvent(self, event: QResizeEvent) -> None:
        self._width = event.size().width()
        super().resizeEvent(event)

    def sizeHint(self) -> QSize:
        return QSize(self._width, self.heightForWidth(self._width))

    def minimumSizeHint(self) -> QSize:
        return QSize(48, 0)


class ReplyBubble(QFrame):
    """An assistant reply: its thinking collapsed (when the model thought), markdown, an error line
    if it failed, the stats line, Copy / Regenerate.

    A streaming reply is rendered block by block (`split_blocks`), a label each, so a
    re-render touches only the blocks that changed, usually the last; a stored reply is
    one label (fewer widgets when a long conversation opens)."""

    def __init__(self, message: StoredMessage | None, dark: bool, width: int, on_regenerate: Callable):
        super().__init__(objectName="replyBubble")
        self.message = message
        self.text = message.content if message else ""
        self.reasoning = message.reasoning if message else ""
        self.thinking_label = stored_label(message.stats) if message else ""
        self.dark = dark
        self.label_width = width - 2 * REPLY_MARGIN_PX
        self.by_block = message is None
        self.blocks: list[tuple[str, _RichLabel]] = []  # (markdown source, its label)
        self.body = QVBoxLayout()
        self.body.setSpacing(8)  # about what Qt puts between paragraphs within one label
        self.error: QLabel | None = None  # made by fail(): most replies never need one
        self.stats = dim(QLabel(objectName="statsLine", wordWrap=True), 0.85)  # wraps in a narrow column
        self.stats.setText(stats_line(message.stats if message else None))
        self.copy_button = _tool_button("Copy", "copyButton", self.copy)
        self.regenerate_button = _tool_button("Regenerate", "regenerateButton", on_regenerate)
        footer = QHBoxLayout()
        footer.addWidget(self.stats, 1)  # takes the width the buttons leave, wrapping only past it
        footer.addWidget(self.copy_button, 0, Qt.AlignmentFlag.AlignTop)
        footer.addWidget(self.regenerate_button, 0, Qt.AlignmentFlag.AlignTop)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(REPLY_MARGIN_PX, 4, REPLY_MARGIN_PX, 0)
        layout.setSpacing(2)
        self.thinking: ThinkingPanel | None = None  # made once there is thinking: most replies have none
        layout.addLayout(self.body)
        layout.addLayout(footer)
        self.render(streaming=message is None)

    def html(self) -> str:
        return "".join(label.text() for _, label in self.blocks)

    def render(self, streaming: bool = False) -> None:
        sources = split_blocks(self.text) if self.by_block else [self.text] if self.text else []
        for index, source in enumerate(sources):
            if index == len(self.blocks):
                label = _RichLabel(render_markdown(source, self.dark), self.label_width)
                self.body.addWidget(label)
                self.blocks.append((source, label))
            elif self.blocks[index][0] != source:
                self.blocks[index][1].setText(render_markdown(source, self.dark))
                self.blocks[index] = (source, self.blocks[index][1])
        for _, label in self.blocks[len(sources) :]:
            discard(label)
        del self.blocks[len(sources) :]
        self._show_thinking()
        if streaming:
            self.stats.setText("generating…")
        self.stats.setVisible(bool(self.stats.text()))
        self.copy_button.setVisible(not streaming and bool(self.text))

    def _show_thinking(self) -> None:
        if self.thinking is None and self.reasoning.strip():
            self.thinking = ThinkingPanel(self.label_width)
            self.layout().insertWidget(0, self.thinking)
        if self.thinking is not None:
            self.thinking.show_thinking(self.reasoning, self.thinking_label)

    def restyle(self, dark: bool, streaming: bool) -> None:
        self.dark = dark
        self.blocks = [("\0", label) for _, label in self.blocks]  # no source matches: all re-render
        self.render(streaming)

    def finish(self, message: StoredMessage) -> None:
        self.message, self.text, self.reasoning = message, message.content, message.reasoning
        self.thinking_label = stored_label(message.stats)
        self.stats.setText(stats_line(message.stats))
        self.render()

    def fail(self, reason: str) -> None:
        self.stats.setText("")
        if self.error is None:
            self.error = QLabel(objectName="replyError", wordWrap=True)
            palette = self.error.palette()
            palette.setColor(QPalette.ColorRole.WindowText, QColor("#d32f2f"))
            self.error.setPalette(palette)
            self.layout().insertWidget(self.layout().count() - 1, self.error)  # above the footer
            self.error.show()
        self.error.setText(f"⚠ {reason}")
        self.render()

    def copy(self) -> None:
        QGuiApplication.clipboard().setText(self.text)
        self.copy_button.setText("Copied")
        QTimer.singleShot(1500, self.copy_button, lambda: self.copy_button.setText("Copy"))


class UserBubble(QWidget):
    """A user message: a tinted card at the right, with Edit (edit in place, then resend)."""

    def __init__(self, message: StoredMessage, fill: QColor, on_resend: Callable[[int, str], None]):
        super().__init__(objectName="userBubble")
        self.message = message
        self.fill = fill
        self._on_resend = on_resend
        self.card = QWidget()  # painted by paintEvent below; no wider than its text
        self.card.setSizePolicy(QSizePolicy.Policy.Maximum, QSizePolicy.Policy.Preferred)
        self.body = _PlainLabel(message.content, textFormat=Qt.TextFormat.PlainText, wordWrap=True)
        _selectable(self.body).setObjectName("messageBody")
        self.editor: InputBox | None = None  # made on the first Edit: most messages are never edited
        self.edit_button = _tool_button("Edit", "editButton", lambda: self.start_editing(True))
        self.actions = QHBoxLayout()
        self.actions.addStretch(1)
        self.actions.addWidget(self.edit_button)
        card = QVBoxLayout(self.card)
        card.setContentsMargins(10, 8, 10, 2)
        card.setSpacing(2)
        card.addWidget(self.body)
        card.addLayout(self.actions)
        row = QHBoxLayout(self)
        row.setContentsMargins(USER_INDENT_PX, 0, 0, 0)
        row.addStretch(1)
        row.addWidget(self.card)

    def _make_editor(self) -> InputBox:
        self.editor = InputBox(objectName="editBox")
        self.editor.sig_submit.connect(self.submit)
        self.cancel_button = QPushButton("Cancel", objectName="cancelEditButton")
        self.cancel_button.clicked.connect(lambda: self.start_editing(False))
        self.send_button = QPushButton("Send", objectName="resendButton")
        self.send_button.clicked.connect(self.submit)
        self.card.layout().insertWidget(1, self.editor)
        self.actions.addWidget(self.cancel_button)
        self.actions.addWidget(self.send_button)
        return self.editor

    def start_editing(self, editing: bool = True) -> None:
        """Swap the text for an editor holding it (editing=False swaps back)."""
        editor = self.editor or self._make_editor()
        if editing:
            editor.setPlainText(self.message.content)
            editor.setFocus()
        width = QSizePolicy.Policy.Expanding if editing else QSizePolicy.Policy.Maximum
        self.card.setSizePolicy(width, QSizePolicy.Policy.Preferred)
        self.body.setVisible(not editing)
        self.edit_button.setVisible(not editing)
        for widget in (editor, self.send_button, self.cancel_button):
            widget.setVisible(editing)

    def submit(self) -> None:
        text = self.editor.toPlainText().strip() if self.editor else ""
        if not text:
            return
        self.start_editing(False)
        self.body.setText(text)
        self._on_resend(self.message.id, text)

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() == Qt.Key.Key_Escape and self.editor is not None and self.editor.isVisible():
            self.start_editing(False)
            return
        super().keyPressEvent(event)

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.setPen(Qt.PenStyle.NoPen)
        painter.setBrush(self.fill)
        painter.drawRoundedRect(self.card.geometry(), 10, 10)
