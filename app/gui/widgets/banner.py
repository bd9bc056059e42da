"""Non-blocking banners stacked at the top of a window, for errors, warnings and notes.

`BannerArea.show_banner(message, kind, actions, key, timeout_ms)` adds a banner
and returns it. A banner with the same `key` as a shown one replaces it in
place (a worker that dies twice shows one banner, not two). Every banner has a
close button; each action is a button that closes the banner and then runs its
callback (so the callback may show a new banner under the same key); a
`timeout_ms` closes it on its own. Nothing here blocks or takes focus: the user
goes on typing while a banner is shown.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QSizePolicy,
    QStyle,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

log = logging.getLogger(__name__)

KINDS = {
    # kind: (background, border, text); explicit colours so a banner reads on light and dark themes
    "error": ("#fce8e6", "#d93025", "#5c0d08"),
    "warning": ("#fef7e0", "#e8a317", "#5c3d00"),
    "info": ("#e8f0fe", "#1a73e8", "#0b2f66"),
}
ICONS = {
    "error": QStyle.StandardPixmap.SP_MessageBoxCritical,
    "warning": QStyle.StandardPixmap.SP_MessageBoxWarning,
    "info": QStyle.StandardPixmap.SP_MessageBoxInformation,
}
ICON_PX = 18

Action = tuple[str, Callable[[], None]]


class Banner(QFrame):
    """One message with its action buttons and a close button."""

    sig_closed = Signal(object)
    """The banner closed (itself): by its close button, an action, its timeout or `close_banner`."""

    def __init__(
        self,
        message: str,
        kind: str,
        actions: Sequence[Action],
        key: str | None,
        parent: QWidget | None = None,
    ):
        super().__init__(parent)
        if kind not in KINDS:
            raise ValueError(f"Unknown banner kind {kind!r}; choose one of {', '.join(KINDS)}.")
        self.message, self.kind, self.key = message, kind, key
        self.closed = False
        self.setObjectName("banner")
        background, border, text = KINDS[kind]
        self.setStyleSheet(
            f"QFrame#banner {{ background: {background}; border: 1px solid {border};"
            f" border-left: 4px solid {border}; border-radius: 3px; }}"
            f" QFrame#banner QLabel {{ color: {text}; background: transparent; border: none; }}"
        )
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 4, 4, 4)
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        icon = QLabel(self)
        icon.setPixmap(self.style().standardIcon(ICONS[kind]).pixmap(ICON_PX, ICON_PX))
        row.addWidget(icon, 0, Qt.AlignmentFlag.AlignVCenter)
        self.label = QLabel(message, self)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row.addWidget(self.label, 1)
        self.action_buttons: list[QPushButton] = []
        for text, callback in actions:
            button = QPushButton(text, self)
            button.setFocusPolicy(Qt.FocusPolicy.NoFocus)
            button.clicked.connect(lambda _=False, run=callback: self._run(run))
            row.addWidget(button)
            self.action_buttons.append(button)
        self.close_button = QToolButton(self)
        self.close_button.setText("✕")
        self.close_button.setAutoRaise(True)
        self.close_button.setToolTip("Dismiss")
        self.close_button.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.close_button.clicked.connect(self.close_banner)
        row.addWidget(self.close_button, 0, Qt.AlignmentFlag.AlignTop)
        self._timer: QTimer | None = None

    def start_timeout(self, timeout_ms: int) -> None:
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.timeout.connect(self.close_banner)
        self._timer.start(timeout_ms)

    def close_banner(self) -> None:
        """Close it (once); the area drops it from its stack."""
        if self.closed:
            return
        self.closed = True
        if self._timer is not None:
            self._timer.stop()
        self.sig_closed.emit(self)

    def _run(self, callback: Callable[[], None]) -> None:
        self.close_banner()
        callback()


class BannerArea(QWidget):
    """A vertical stack of banners; it takes no space while empty."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._layout = QVBoxLayout(self)
        self._layout.setContentsMargins(0, 0, 0, 0)
        self._layout.setSpacing(4)
        self._banners: list[Banner] = []
        self.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Maximum)
        self.hide()

    def show_banner(
        self,
        message: str,
        kind: str = "error",
        actions: Sequence[Action] = (),
        key: str | None = None,
        timeout_ms: int | None = None,
    ) -> Banner:
        """Show a banner (replacing the one with the same `key`) and return it."""
        banner = Banner(message, kind, actions, key, self)
        banner.sig_closed.connect(self._remove)
        old = next((b for b in self._banners if key is not None and b.key == key), None)
        if old is not None:
            index = self._banners.index(old)
            self._discard(old)
            self._banners.insert(index, banner)
            self._layout.insertWidget(index, banner)
        else:
            self._banners.append(banner)
            self._layout.addWidget(banner)
        banner.show()  # a child added to a shown parent stays hidden until shown
        if timeout_ms is not None:
            banner.start_timeout(timeout_ms)
        log.debug("banner (%s, key %s): %s", kind, key, message)
        self.setVisible(True)
        return banner

    def clear(self, key: str | None = None) -> None:
        """Close the banner shown under `key`; with no key, close them all."""
        for banner in list(self._banners):
            if key is None or banner.key == key:
                banner.close_banner()

    def banners(self) -> list[Banner]:
        """The banners shown now, top first."""
        return list(self._banners)

    def _remove(self, banner: Banner) -> None:
        if banner in self._banners:
            self._discard(banner)
        self.setVisible(bool(self._banners))

    def _discard(self, banner: Banner) -> None:
        banner.closed = True  # a replaced banner's timer or buttons must do nothing any more
        self._banners.remove(banner)
        self._layout.removeWidget(banner)
        banner.hide()
        banner.deleteLater()
