"""The QApplication: named, with the icon and the desktop entry's name."""

from __future__ import annotations

import sys


def application(qt_args: list[str]):
    """The QApplication, named, with the icon and the desktop entry's name."""
    from PySide6.QtWidgets import QApplication

    app = QApplication.instance() or QApplication([sys.argv[0], *qt_args])
    app.setApplicationName("MoE Chat")
    app.setOrganizationName("MoE Chat")
    app.setDesktopFileName("moe-chat")  # Wayland and the taskbar match the window to moe-chat.desktop
    app.setWindowIcon(app_icon())
    return app


def app_icon():
    """The MoE Chat icon in every size shipped in resources/icons (Qt picks the nearest)."""
    from PySide6.QtGui import QIcon

    from engine.resources import resources_dir

    icon = QIcon()
    for png in sorted((resources_dir() / "icons").glob("moe-chat-*.png")):
        icon.addFile(str(png))
    return icon
