"""Windows that fit their screen, and the main window's geometry remembered between starts.

`fit_rect(preferred, available, frame)` is the pure rule: the preferred size,
shrunk to the screen's available area less the window frame, centred on it.
`fit_to_screen(window)` applies it to any top-level window or dialog.
`WindowMemory` keeps the main window's geometry, its docks' state and its
splitters' sizes in an INI file beside the app's settings (one folder that
tests isolate with MOE_CHAT_CONFIG_DIR), and refits a remembered geometry that
no longer fits (a smaller screen than last time).
"""

from __future__ import annotations

import logging
from pathlib import Path

from PySide6.QtCore import QByteArray, QMargins, QRect, QSettings, QSize
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QMainWindow, QSplitter, QWidget

log = logging.getLogger(__name__)

WINDOW_FILE = "window.ini"
# The frame a window manager adds around a window not yet shown (title bar and borders); a
# shown window's real frame is used instead.
FRAME_GUESS = QMargins(4, 32, 4, 4)


def available_geometry(widget: QWidget | None = None) -> QRect:
    """The screen area free of panels and docks: the widget's screen, else the primary one."""
    screen = widget.screen() if widget is not None else None
    screen = screen or QGuiApplication.primaryScreen()
    return screen.availableGeometry()


def frame_margins(window: QWidget) -> QMargins:
    """The window frame: measured once shown, else `FRAME_GUESS`."""
    if not window.isVisible():
        return FRAME_GUESS
    frame, inner = window.frameGeometry(), window.geometry()
    return QMargins(
        inner.left() - frame.left(),
        inner.top() - frame.top(),
        frame.right() - inner.right(),
        frame.bottom() - inner.bottom(),
    )


def fit_rect(preferred: QSize, available: QRect, frame: QMargins) -> QRect:
    """The window's (inner) geometry: `preferred` shrunk to fit `available` with its frame, centred."""
    room = available.marginsRemoved(frame)
    size = preferred.boundedTo(room.size())
    left = room.left() + (room.width() - size.width()) // 2
    top = room.top() + (room.height() - size.height()) // 2
    return QRect(left, top, size.width(), size.height())


def fits(window: QWidget, available: QRect) -> bool:
    """Whether the window with its frame lies inside `available`."""
    return available.contains(window.geometry().marginsAdded(frame_margins(window)))


def fit_to_screen(window: QWidget, preferred: QSize | None = None, available: QRect | None = None) -> None:
    """Size and place `window` on its screen: `preferred` (its current size) shrunk to fit."""
    available = available if available is not None else available_geometry(window)
    margins = frame_margins(window)
    rect = fit_rect(preferred or window.size(), available, margins)
    window.resize(rect.size())
    window.move(rect.left() - margins.left(), rect.top() - margins.top())  # a window moves by its frame


class WindowMemory:
    """The main window's geometry, dock state and splitter sizes, in `folder`/window.ini."""

    def __init__(self, folder: Path):
        self.settings = QSettings(str(Path(folder) / WINDOW_FILE), QSettings.Format.IniFormat)

    def restore(
        self, window: QMainWindow, splitters: dict[str, QSplitter], available: QRect | None = None
    ) -> bool:
        """Put back what was saved; False (nothing changed) on a first start or an unreadable file."""
        geometry = self.settings.value("window/geometry")
        if not isinstance(geometry, QByteArray) or not window.restoreGeometry(geometry):
            return False
        state = self.settings.value("window/state")
        if isinstance(state, QByteArray):
            window.restoreState(state)
        for name, splitter in splitters.items():
            sizes = self.settings.value(f"splitters/{name}")
            if isinstance(sizes, QByteArray):
                splitter.restoreState(sizes)
        available = available if available is not None else available_geometry(window)
        if not fits(window, available):  # saved on a larger screen
            fit_to_screen(window, available=available)
        return True

    def save(self, window: QMainWindow, splitters: dict[str, QSplitter]) -> None:
        self.settings.setValue("window/geometry", window.saveGeometry())
        self.settings.setValue("window/state", window.saveState())
        for name, splitter in splitters.items():
            self.settings.setValue(f"splitters/{name}", splitter.saveState())
        self.settings.sync()
        if self.settings.status() is not QSettings.Status.NoError:
            log.warning("Could not save the window's geometry to %s", self.settings.fileName())
