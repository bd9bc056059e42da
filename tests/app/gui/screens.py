"""Helpers for the screen tests: where screenshots go, and geometry facts about shown widgets.

Screenshots go to $MOE_CHAT_SCREENSHOTS when it names a folder (docs/screenshots/ to update the
committed ones), else to the test's tmp_path.
"""

import os
from pathlib import Path

from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QWidget


def save_png(widget: QWidget, name: str, tmp_path: Path) -> Path:
    folder = Path(os.environ.get("MOE_CHAT_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    assert widget.grab().save(str(path)), f"could not save {path}"
    return path


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
