"""The conversation pane: the bubbles of one conversation, the streaming reply and the input box.

`ChatView` shows one `Conversation` and knows nothing of the engine or the
store: it emits what the user asked for (`sig_send`, `sig_stop`,
`sig_regenerate`, `sig_edit_resend`) and whoever owns it answers with
`begin_reply` / `append_reply_text` / `end_reply` or `fail_reply`, and with
`set_conversation` whenever the stored messages change. Showing the same
conversation again keeps the bubbles of the unchanged leading messages and
rebuilds only the tail (a send, a regenerate, an edit cost one or two bubbles).
A long conversation opens newest first: the last `OPEN_BATCH` messages at once,
the older ones a batch per event-loop turn, so the window never freezes.

Streaming is cheap by construction: `append_reply_text` only buffers; a
single-shot timer re-renders the one streaming bubble at most every
`STREAM_RENDER_MS`, never per token (`stream_render_count` counts those
renders), and within it only the markdown blocks that changed. While a reply
streams the view follows the bottom unless the user has scrolled up.
The bubbles themselves live in `app.gui.chat.chat_bubbles`.
"""

from __future__ import annotations

import logging

from PySide6.QtCore import QEvent, QSignalBlocker, Qt, QTimer, Signal
from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton, QScrollArea, QVBoxLayout, QWidget

from app.gui.chat.chat_bubbles import InputBox, ReplyBubble, UserBubble, dim, discard, stats_line
from app.storage import Conversation, StoredMessage

__all__ = ["OPEN_BATCH", "STREAM_RENDER_MS", "ChatView", "stats_line"]

log = logging.getLogger(__name__)

STREAM_RENDER_MS = 100  # the streaming bubble is re-rendered at most this often
OPEN_BATCH = 8  # messages built per event-loop turn while a conversation opens
FOLLOW_SLACK_PX = 24  # this close to the bottom still counts as "at the bottom"
INPUT_LINES = (2, 8)  # the input box grows with its text between these line counts
PAGE_MARGIN_PX = 16
PLACEHOLDER = "Message — Enter sends, Shift+Enter starts a new line"
_ROLES = ("user", "assistant")  # a stored "system" message, if any, is not shown


def _mix(a: QColor, b: QColor, weight: float) -> QColor:
    """`a` moved towards `b` by `weight` (0: a, 1: b)."""
    channels = zip(a.getRgb()[:3], b.getRgb()[:3], strict=True)
    return QColor(*(round(x * (1 - weight) + y * weight) for x, y in channels))


class ChatView(QWidget):
    """One conversation: bubbles in a scroll area, the input box and Send / Stop."""

    sig_send = Signal(str)
    """The user sent a message: its text (the input box is already cleared)."""
    sig_stop = Signal()
    """The user asked to stop the streaming reply."""
    sig_regenerate = Signal()
    """The user asked for a new version of the last reply."""
    sig_edit_resend = Signal(int, str)
    """The user edited a sent message: its id and the new text (resend from there)."""
    sig_think = Signal(bool)
    """The user switched this chat's thinking on or off (models that think in a <think> block)."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.stream_render_count = 0  # streaming re-renders so far (tests check the throttle)
        self._busy = False
        self._input_enabled = True
        self._conversation_id: int | None = None
        self._bubbles: list[ReplyBubble | UserBubble] = []
        self._backlog: list[StoredMessage] = []  # older messages not built yet, oldest first
        self._streaming: ReplyBubble | None = None
        self._pending: list[str] = []  # streamed text not rendered yet
        self._follow = True  # keep the bottom in view
        self._prepending = False  # older bubbles were just added above: keep the view still
        self._bottom_offset = 0  # how far the view is from the bottom
        self._render_timer = QTimer(self, singleShot=True, interval=STREAM_RENDER_MS)
        self._render_timer.timeout.connect(self._render_stream)
        self._backlog_timer = QTimer(self, interval=0)
        self._backlog_timer.timeout.connect(self._build_backlog)

        self._scroll = QScrollArea(widgetResizable=True, frameShape=QFrame.Shape.NoFrame)
        self._scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        # Always on: "as needed" lays every reply out at two widths, with and without it.
        self._scroll.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOn)
        bar = self._scroll.verticalScrollBar()
        bar.valueChanged.connect(self._on_scrolled)
        bar.rangeChanged.connect(self._on_range_changed)
        self._scroll.setWidget(self._new_page())

        self.input = InputBox(objectName="chatInput", placeholderText=PLACEHOLDER)
        self.input.sig_submit.connect(self._submit)
        self.input.document().contentsChanged.connect(self._fit_input)
        self.send_button = QPushButton("Send", objectName="sendButton")
        self.send_button.clicked.connect(lambda: self.sig_stop.emit() if self._busy else self._submit())
        self.think_button = QPushButton("Think", objectName="thinkButton", checkable=True, checked=True)
        self.think_button.setToolTip("Let the model think before it answers (its thinking shows collapsed).")
        self.think_button.toggled.connect(self.sig_think)
        self.think_button.hide()  # shown for a model that thinks
        row = QHBoxLayout()
        row.setContentsMargins(12, 0, 12, 0)
        row.addWidget(self.input, 1)
        row.addWidget(self.think_button, 0, Qt.AlignmentFlag.AlignBottom)
        row.addWidget(self.send_button, 0, Qt.AlignmentFlag.AlignBottom)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 8)
        layout.addWidget(self._scroll, 1)
        layout.addLayout(row)
        self._fit_input()

    # ---- conversation ----------------------------------------------------------------------------

    def set_conversation(self, conversation: Conversation | None) -> None:
        """Show this conversation (None: an empty view), dropping any streaming state."""
        self._reset_stream()
        messages = [m for m in (conversation.messages if conversation else ()) if m.role in _ROLES]
        same = conversation is not None and conversation.id == self._conversation_id
        kept = self._keep_common_start(messages) if same else None
        if kept is None:
            self._rebuild(messages)
        else:
            for message in messages[kept:]:
                self._add_bubble(message)
        self._conversation_id = conversation.id if conversation else None
        self._follow = True
        self._after_change()

    @property
    def building(self) -> bool:
        """True while older messages of the conversation are still being added."""
        return bool(self._backlog)

    def begin_reply(self) -> None:
        """Start an empty assistant bubble that `append_reply_text` fills."""
        self._reset_stream()
        self._streaming = self._new_reply()
        self._follow = True
        self._after_change()

    def append_reply_text(self, text: str, reasoning: str = "", thinking_label: str = "") -> None:
        """Buffer streamed text (and thinking, with its header); the bubble is re-rendered by a
        timer, not here."""
        if self._streaming is None:
            log.debug("reply text with no reply streaming: dropped")
            return
        self._pending.append(text)
        self._streaming.reasoning += reasoning
        self._streaming.thinking_label = thinking_label or self._streaming.thinking_label
        if not self._render_timer.isActive():
            self._render_timer.start()

    def end_reply(self, message: StoredMessage) -> None:
        """The reply is complete and stored: final render with its stats line."""
        bubble = self._streaming or self._new_reply()
        self._reset_stream()
        bubble.finish(message)
        self._after_change()

    def fail_reply(self, message: str) -> None:
        """The reply failed: keep what streamed so far and show why under it."""
        bubble = self._streaming or self._new_reply()
        self._flush_pending()
        self._reset_stream()
        bubble.fail(message)
        self._after_change()

    # ---- state -----------------------------------------------------------------------------------

    def set_busy(self, busy: bool) -> None:
        """While busy (a reply streams) Send becomes Stop and Edit / Regenerate are off."""
        self._busy = busy
        self.send_button.setText("Stop" if busy else "Send")
        self._update_controls()

    def set_thinking(self, available: bool, on: bool) -> None:
        """Show the Think toggle (for a model that thinks) in this chat's state; no signal."""
        self.think_button.setVisible(available)
        with QSignalBlocker(self.think_button):
            self.think_button.setChecked(on)

    def set_input_enabled(self, enabled: bool, reason: str = "") -> None:
        """Allow or refuse sending; `reason` says why not (shown in the empty input box)."""
        self._input_enabled = enabled
        self.input.setEnabled(enabled)
        self.input.setPlaceholderText(PLACEHOLDER if enabled or not reason else reason)
        self.send_button.setToolTip("" if enabled else reason)
        self._update_controls()

    # ---- building --------------------------------------------------------------------------------

    def _new_page(self) -> QWidget:
        """A fresh, empty page for the scroll area (the caller sets it once it is filled)."""
        page = QWidget(objectName="chatPage")
        page.setBackgroundRole(QPalette.ColorRole.Base)
        self._page_layout = QVBoxLayout(page)
        self._page_layout.setContentsMargins(PAGE_MARGIN_PX, 12, PAGE_MARGIN_PX, 12)
        self._page_layout.setSpacing(12)
        self._empty_hint = dim(QLabel("Ask anything: the reply streams here as it is generated."))
        self._empty_hint.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self._page_layout.addWidget(self._empty_hint)
        self._page_layout.addStretch(1)
        self._bubbles = []
        return page

    def _rebuild(self, messages: list[StoredMessage]) -> None:
        """A new page with the newest messages; the older ones follow from the backlog timer."""
        page = self._new_page()
        self._backlog = messages[: max(0, len(messages) - OPEN_BATCH)]
        for message in messages[len(self._backlog) :]:
            self._add_bubble(message)
        page.resize(self._scroll.viewport().width(), page.height())  # else setWidget sizes it to its hint
        self._scroll.setWidget(page)  # the old page and its bubbles go with it
        if self._backlog:
            self._backlog_timer.start()
        else:
            self._backlog_timer.stop()

    def _keep_common_start(self, messages: list[StoredMessage]) -> int | None:
        """Drop the bubbles after the messages shown that still start `messages`; how many are kept.

        None when they differ within the backlog (not built yet): then the page is rebuilt."""
        shown = self._backlog + [bubble.message for bubble in self._bubbles]
        common = 0
        while common < min(len(shown), len(messages)) and shown[common] == messages[common]:
            common += 1
        if common < len(self._backlog):
            return None
        for bubble in self._bubbles[common - len(self._backlog) :]:
            discard(bubble)
        del self._bubbles[common - len(self._backlog) :]
        return common

    def _build_backlog(self) -> None:
        batch = self._backlog[-OPEN_BATCH:]
        del self._backlog[-OPEN_BATCH:]
        self._prepending = True
        for index, message in enumerate(batch):
            self._add_bubble(message, at=index)
        if not self._backlog:
            self._backlog_timer.stop()
        self._update_controls()

    def _add_bubble(self, message: StoredMessage, at: int | None = None) -> None:
        if message.role == "user":
            self._insert(UserBubble(message, self._user_fill(), self.sig_edit_resend.emit), at)
        else:
            self._new_reply(message, at)

    def _new_reply(self, message: StoredMessage | None = None, at: int | None = None) -> ReplyBubble:
        width = self._scroll.viewport().width() - 2 * PAGE_MARGIN_PX
        return self._insert(ReplyBubble(message, self._dark(), width, self.sig_regenerate.emit), at)

    def _insert(self, bubble: ReplyBubble | UserBubble, at: int | None) -> ReplyBubble | UserBubble:
        """Add a bubble at the end, or at position `at` among the bubbles."""
        at = len(self._bubbles) if at is None else at
        self._page_layout.insertWidget(1 + at, bubble)  # 0 is the empty hint
        if self._page_layout.parentWidget().isVisible():
            bubble.show()  # now, not on the layout's queued show: callers may look at it at once
        self._bubbles.insert(at, bubble)
        return bubble

    def _after_change(self) -> None:
        self._empty_hint.setVisible(not self._bubbles and not self._backlog)
        self._update_controls()

    def _update_controls(self) -> None:
        can_act = self._input_enabled and not self._busy
        self.send_button.setEnabled(self._busy or self._input_enabled)
        last = self._bubbles[-1] if self._bubbles else None
        for bubble in self._bubbles:
            if isinstance(bubble, ReplyBubble):
                bubble.regenerate_button.setVisible(bubble is last and bubble is not self._streaming)
                bubble.regenerate_button.setEnabled(can_act)
            else:
                bubble.edit_button.setEnabled(can_act)

    # ---- streaming, input, scrolling -------------------------------------------------------------

    def _reset_stream(self) -> None:
        self._render_timer.stop()
        self._streaming = None
        self._pending = []

    def _flush_pending(self) -> None:
        if self._streaming is not None and self._pending:
            self._streaming.text += "".join(self._pending)
            self._pending = []

    def _render_stream(self) -> None:
        if self._streaming is None:
            return
        self._flush_pending()
        self.stream_render_count += 1
        self._streaming.render(streaming=True)

    def _submit(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self._busy or not self._input_enabled:
            return
        self.input.clear()
        self.sig_send.emit(text)

    def _on_scrolled(self, value: int) -> None:
        maximum = self._scroll.verticalScrollBar().maximum()
        self._follow = value >= maximum - FOLLOW_SLACK_PX
        self._bottom_offset = maximum - value

    def _on_range_changed(self, _minimum: int, maximum: int) -> None:
        bar = self._scroll.verticalScrollBar()
        if self._follow:
            bar.setValue(maximum)
        elif self._prepending:  # older messages appeared above: the text being read stays put
            bar.setValue(maximum - self._bottom_offset)
        self._prepending = False
        self._bottom_offset = maximum - bar.value()

    def _fit_input(self) -> None:
        lines = max(1, round(self.input.document().size().height()))  # a plain text document counts lines
        shown = min(max(lines, INPUT_LINES[0]), INPUT_LINES[1])
        margins = self.input.contentsMargins()
        frame = 2 * self.input.document().documentMargin() + margins.top() + margins.bottom()
        self.input.setFixedHeight(round(shown * self.input.fontMetrics().lineSpacing() + frame))

    # ---- colours ---------------------------------------------------------------------------------

    def _dark(self) -> bool:
        return self.palette().color(QPalette.ColorRole.Window).lightness() < 128

    def _user_fill(self) -> QColor:
        palette = self.palette()
        return _mix(palette.color(QPalette.ColorRole.Base), palette.color(QPalette.ColorRole.Highlight), 0.14)

    def changeEvent(self, event: QEvent) -> None:
        if event.type() == QEvent.Type.PaletteChange:  # e.g. a light/dark switch: recolour the bubbles
            for bubble in self._bubbles:
                if isinstance(bubble, UserBubble):
                    bubble.fill = self._user_fill()
                    bubble.update()
                elif bubble.dark != self._dark():
                    bubble.restyle(self._dark(), streaming=bubble is self._streaming)
        super().changeEvent(event)
