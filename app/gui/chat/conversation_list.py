"""The sidebar of saved conversations: search, list, New / Rename / Delete.

`ConversationList` reads and writes a `ConversationStore` directly for rename
and delete; creating a chat is left to its owner (`sig_new_requested`), which
then calls `refresh()` and `select(id)`. The search field filters as the user
types, debounced by `SEARCH_DEBOUNCE_MS`. `select()` and `refresh()` never emit
`sig_selected`; only the user's choice does.

The dialogs go through three callable attributes so tests (and other front
ends) can answer them: `confirm(parent, title) -> bool` before a delete,
`ask_title(parent, current) -> str | None` for a rename, and
`report_error(parent, message)` when the store fails.
"""

from __future__ import annotations

import time
from datetime import datetime

from PySide6.QtCore import QModelIndex, QPoint, QRect, QSize, Qt, QTimer, Signal
from PySide6.QtGui import QAction, QFont, QPainter, QPalette
from PySide6.QtWidgets import (
    QHBoxLayout,
    QInputDialog,
    QLineEdit,
    QListWidget,
    QListWidgetItem,
    QMenu,
    QMessageBox,
    QPushButton,
    QStyle,
    QStyledItemDelegate,
    QStyleOptionViewItem,
    QVBoxLayout,
    QWidget,
)

from app.storage import ConversationStore, ConversationSummary, StorageError

SEARCH_DEBOUNCE_MS = 200
_SUMMARY_ROLE = Qt.ItemDataRole.UserRole + 1


def relative_time(timestamp: float, now: float | None = None) -> str:
    """'just now', '5 min ago', '3 h ago', 'yesterday', a weekday, or a date (local time)."""
    now = time.time() if now is None else now
    seconds = max(0.0, now - timestamp)
    then, today = datetime.fromtimestamp(timestamp), datetime.fromtimestamp(now)
    days = (today.date() - then.date()).days
    if seconds < 60:
        return "just now"
    if seconds < 3600:
        return f"{int(seconds // 60)} min ago"
    if days <= 0:
        return f"{int(seconds // 3600)} h ago"
    if days == 1:
        return "yesterday"
    if days < 7:
        return then.strftime("%A")
    if then.year == today.year:
        return f"{then.day} {then.strftime('%b')}"
    return f"{then.day} {then.strftime('%b %Y')}"


def _ask_delete(parent: QWidget, title: str) -> bool:
    answer = QMessageBox.question(
        parent,
        "Delete chat",
        f"Delete “{title}” and all its messages? This cannot be undone.",
        QMessageBox.StandardButton.Yes | QMessageBox.StandardButton.Cancel,
        QMessageBox.StandardButton.Cancel,
    )
    return answer == QMessageBox.StandardButton.Yes


def _ask_title(parent: QWidget, current: str) -> str | None:
    title, ok = QInputDialog.getText(parent, "Rename chat", "Title:", QLineEdit.EchoMode.Normal, current)
    return title if ok else None


def _show_error(parent: QWidget, message: str) -> None:
    QMessageBox.warning(parent, "Chats", message)


class _SummaryDelegate(QStyledItemDelegate):
    """Two lines per chat: the title, then when it was last active and how it ends, dimmer."""

    def sizeHint(self, option: QStyleOptionViewItem, index: QModelIndex) -> QSize:
        line = option.fontMetrics.lineSpacing()
        return QSize(option.rect.width(), int(line * 2.3) + 12)

    def paint(self, painter: QPainter, option: QStyleOptionViewItem, index: QModelIndex) -> None:
        summary: ConversationSummary = index.data(_SUMMARY_ROLE)
        self.initStyleOption(option, index)
        option.text = ""
        widget = option.widget
        style = widget.style() if widget else None
        if style:
            style.drawControl(QStyle.ControlElement.CE_ItemViewItem, option, painter, widget)
        selected = bool(option.state & QStyle.StateFlag.State_Selected)
        role = QPalette.ColorRole.HighlightedText if selected else QPalette.ColorRole.Text
        rect = option.rect.adjusted(10, 6, -10, -6)
        painter.save()
        title_font = QFont(option.font)
        title_font.setBold(True)
        painter.setFont(title_font)
        painter.setPen(option.palette.color(role))
        line = option.fontMetrics.lineSpacing()
        elided = painter.fontMetrics().elidedText(summary.title, Qt.TextElideMode.ElideRight, rect.width())
        painter.drawText(
            QRect(rect.left(), rect.top(), rect.width(), line), Qt.AlignmentFlag.AlignLeft, elided
        )
        small = QFont(option.font)
        small.setPointSizeF(option.font.pointSizeF() * 0.85)
        painter.setFont(small)
        painter.setOpacity(0.7)
        when = relative_time(summary.updated_at)
        detail = f"{when} · {summary.preview}" if summary.preview else when
        detail = painter.fontMetrics().elidedText(detail, Qt.TextElideMode.ElideRight, rect.width())
        detail_rect = QRect(rect.left(), rect.top() + line + 2, rect.width(), line)
        painter.drawText(detail_rect, Qt.AlignmentFlag.AlignLeft, detail)
        painter.restore()


class ConversationList(QWidget):
    """Saved chats, newest first, with search, New, Rename and Delete (buttons and context menu)."""

    sig_selected = Signal(int)
    """The user chose a conversation: its id."""
    sig_new_requested = Signal()
    """The user asked for a new chat (the owner creates it, then calls refresh and select)."""
    sig_renamed = Signal(int, str)
    """A conversation was renamed: its id and the new title."""
    sig_deleted = Signal(int)
    """A conversation was deleted: its id (it is no longer current)."""

    def __init__(self, store: ConversationStore, parent: QWidget | None = None):
        super().__init__(parent)
        self.store = store
        self.confirm = _ask_delete
        self.ask_title = _ask_title
        self.report_error = _show_error
        self._current: int | None = None
        self._quiet = False  # True while the list is changed by code, not by the user

        self.search = QLineEdit(
            placeholderText="Search chats", clearButtonEnabled=True, objectName="chatSearch"
        )
        self._search_timer = QTimer(self, singleShot=True, interval=SEARCH_DEBOUNCE_MS)
        self._search_timer.timeout.connect(self.refresh)
        self.search.textChanged.connect(self._search_timer.start)
        self.chats = QListWidget(objectName="chatList")
        self.chats.setItemDelegate(_SummaryDelegate(self.chats))
        self.chats.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.chats.customContextMenuRequested.connect(self._show_context_menu)
        self.chats.currentItemChanged.connect(self._on_current_changed)
        self.new_button = QPushButton("New", objectName="newChatButton")
        self.new_button.clicked.connect(self.sig_new_requested.emit)
        self.rename_button = QPushButton("Rename", objectName="renameChatButton")
        self.rename_button.clicked.connect(lambda: self.rename(self._current))
        self.delete_button = QPushButton("Delete", objectName="deleteChatButton")
        self.delete_button.clicked.connect(lambda: self.delete(self._current))
        buttons = QHBoxLayout()
        for button in (self.new_button, self.rename_button, self.delete_button):
            # As narrow as the text allows (a style's usual ~80 px minimum would widen a narrow list).
            button.setMinimumWidth(button.fontMetrics().horizontalAdvance(button.text()) + 20)
            buttons.addWidget(button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.search)
        layout.addWidget(self.chats, 1)
        layout.addLayout(buttons)
        self.refresh()

    # ---- public ----------------------------------------------------------------------------------

    def refresh(self) -> None:
        """Reload the list from the store with the current search; keeps the current chat selected."""
        self._search_timer.stop()
        try:
            summaries = self.store.list(self.search.text())
        except StorageError as exc:
            self.report_error(self, str(exc))
            return
        self._quiet = True
        try:
            self.chats.clear()
            for summary in summaries:
                item = QListWidgetItem()
                item.setData(Qt.ItemDataRole.UserRole, summary.id)
                item.setData(_SUMMARY_ROLE, summary)
                item.setToolTip(summary.preview or summary.title)
                self.chats.addItem(item)
            self._show_current()
        finally:
            self._quiet = False
        self._update_buttons()

    def select(self, conversation_id: int | None) -> None:
        """Make this conversation the current one (without emitting `sig_selected`)."""
        self._current = conversation_id
        self._quiet = True
        try:
            self._show_current()
        finally:
            self._quiet = False
        self._update_buttons()

    def current_id(self) -> int | None:
        return self._current

    def ids(self) -> list[int]:
        """The ids shown, top to bottom."""
        return [self.chats.item(row).data(Qt.ItemDataRole.UserRole) for row in range(self.chats.count())]

    def rename(self, conversation_id: int | None) -> None:
        """Ask for a new title and store it."""
        summary = self._summary(conversation_id)
        if summary is None:
            return
        title = self.ask_title(self, summary.title)
        if title is None or not title.strip() or title.strip() == summary.title:
            return
        try:
            self.store.rename(summary.id, title.strip())
        except (StorageError, KeyError) as exc:
            self.report_error(self, f"Could not rename the chat: {exc}")
            return
        self.refresh()
        self.sig_renamed.emit(summary.id, title.strip())

    def delete(self, conversation_id: int | None) -> None:
        """After confirmation, delete the conversation; the current chat moves to a neighbour."""
        summary = self._summary(conversation_id)
        if summary is None or not self.confirm(self, summary.title):
            return
        ids = self.ids()
        try:
            self.store.delete(summary.id)
        except (StorageError, KeyError) as exc:
            self.report_error(self, f"Could not delete the chat: {exc}")
            return
        was_current = summary.id == self._current
        if was_current:
            self._current = None
        self.refresh()
        self.sig_deleted.emit(summary.id)
        if was_current:
            neighbour = _neighbour(ids, summary.id)
            if neighbour is not None:
                self.select(neighbour)
                self.sig_selected.emit(neighbour)

    def context_menu(self, conversation_id: int | None) -> QMenu:
        """The menu shown on a right click over this conversation (None: over no chat)."""
        menu = QMenu(self)
        menu.addAction(QAction("New chat", menu, triggered=lambda: self.sig_new_requested.emit()))
        for text, handler in (("Rename…", self.rename), ("Delete…", self.delete)):
            action = QAction(text, menu, triggered=lambda _=False, h=handler: h(conversation_id))
            action.setEnabled(conversation_id is not None)
            menu.addAction(action)
        return menu

    # ---- internals -------------------------------------------------------------------------------

    def _summary(self, conversation_id: int | None) -> ConversationSummary | None:
        for row in range(self.chats.count()):
            summary = self.chats.item(row).data(_SUMMARY_ROLE)
            if summary.id == conversation_id:
                return summary
        return None

    def _show_current(self) -> None:
        for row in range(self.chats.count()):
            if self.chats.item(row).data(Qt.ItemDataRole.UserRole) == self._current:
                self.chats.setCurrentRow(row)
                return
        self.chats.setCurrentRow(-1)

    def _on_current_changed(self, item: QListWidgetItem | None, _previous: QListWidgetItem | None) -> None:
        if self._quiet or item is None:
            return
        self._current = item.data(Qt.ItemDataRole.UserRole)
        self._update_buttons()
        self.sig_selected.emit(self._current)

    def _update_buttons(self) -> None:
        shown = self._summary(self._current) is not None
        self.rename_button.setEnabled(shown)
        self.delete_button.setEnabled(shown)

    def _show_context_menu(self, position: QPoint) -> None:
        item = self.chats.itemAt(position)
        conversation_id = item.data(Qt.ItemDataRole.UserRole) if item else None
        self.context_menu(conversation_id).exec(self.chats.viewport().mapToGlobal(position))


def _neighbour(ids: list[int], removed: int) -> int | None:
    """The chat shown after `removed` (or before it, if it was the last)."""
    index = ids.index(removed) if removed in ids else -1
    rest = [i for i in ids if i != removed]
    if not rest or index < 0:
        return None
    return rest[min(index, len(rest) - 1)]
