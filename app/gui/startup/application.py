"""The QApplication (named, with the icon and the desktop entry's name), and what the app
does once on its first start on a GPU: offer the auto-tune wizard (`FirstGpuTuneOffer`)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from PySide6.QtCore import QObject

log = logging.getLogger(__name__)


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


TUNE_OFFERED_FILE = "tune-offered"  # beside settings.json: the first-start offer is made once


class FirstGpuTuneOffer(QObject):
    """On the first start on a GPU, once the model is loaded, a banner offers the auto-tune wizard.

    The worker's Ready event says which device it runs on; the offer is made once per user (a
    marker file beside the settings) and never on a CPU, where tuning has no link to measure."""

    def __init__(self, window, marker: Path | None = None):
        super().__init__(window)
        self.window = window
        self.marker = marker or window.settings_store.path.parent / TUNE_OFFERED_FILE
        self.gpu_name: str | None = None
        window.client.sig_ready.connect(self._on_ready)
        window.client.sig_loaded.connect(self._on_loaded)

    def _on_ready(self, ready) -> None:
        self.gpu_name = ready.device.name if ready.device.kind == "cuda" else None

    def _on_loaded(self, _request_id: str, _model: dict) -> None:
        if self.gpu_name is None or self.marker.exists():
            return
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.touch()
        except OSError:  # a read-only config folder: offer it all the same
            log.info("Cannot write %s: the auto-tune offer may come again", self.marker)
        text = (
            f"First start on {self.gpu_name}: auto-tune measures this machine and picks the "
            "expert cache, draft length and prefetch cutoff (about a minute)."
        )
        self.window.banners.show_banner(
            text, "info", [("Auto-tune…", self.window.open_tune_wizard)], key="first-tune"
        )
