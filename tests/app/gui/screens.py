"""Helpers for the screen tests: geometry facts about shown widgets, and their screenshots.

Screenshots go where every test's go (tests/screenshots.py): $MOE_CHAT_SCREENSHOT_DIR when set
(docs/screenshots/ to update the committed ones), else the test's tmp_path.
"""

from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QWidget


def rect_in(widget: QWidget, ancestor: QWidget) -> QRect:
    """`widget`'s rectangle in `ancestor`'s coordinates."""
    return QRect(widget.mapTo(ancestor, QPoint(0, 0)), widget.size())


def assert_fully_shown(widget: QWidget, window: QWidget) -> None:
    """Shown, inside the window's rectangle, and not clipped by any parent (a scroll area's
    viewport, a too-narrow column): its visible region is its whole rectangle."""
    name = widget.objectName() or type(widget).__name__
    assert widget.isVisible(), f"{name} is hidden"
    assert window.rect().contains(rect_in(widget, window)), f"{name} lies outside the window"
    visible = widget.visibleRegion().boundingRect()
    assert visible == widget.rect(), f"{name} is clipped: {visible} of {widget.rect()}"
