"""The app's defaults show the product: with empty settings it speculates and prefetches, and
the first start on a GPU offers the auto-tune wizard."""

import pytest
from PySide6.QtCore import QObject, Signal
from PySide6.QtWidgets import QWidget

from app.gui.startup.application import FirstGpuTuneOffer
from app.gui.widgets.banner import BannerArea
from app.gui.window.main_window import MainWindow
from app.settings import AppSettings, SettingsStore
from engine.worker.protocol import DeviceInfo, Ready

START_MS = 90_000


@pytest.mark.gui
@pytest.mark.slow
def test_with_empty_settings_a_reply_is_speculative_with_prefetch(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_CHAT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("MOE_CHAT_CONFIG_DIR", str(tmp_path / "config"))
    window = MainWindow()
    qtbot.addWidget(window)
    assert not SettingsStore().path.exists(), "no settings: every setting is its default"
    assert window.settings == AppSettings()
    assert (window.settings.spec_mode, window.settings.prefetch) == ("auto", "auto")
    window.show()
    with qtbot.waitSignal(window.client.sig_loaded, timeout=START_MS):
        window.start_engine()
    window.new_conversation()
    with qtbot.waitSignal(window.session.sig_reply_ended, timeout=60_000) as done:
        window.chat_view.sig_send.emit("What sound does a cow make?")
    stats = done.args[0].finished.stats
    assert stats["spec"] == "draft", "the demo's bundled draft model drafts"
    assert stats["prefetch"].startswith("spmoe")
    assert stats["accept_len"] is not None and stats["accept_len"] >= 1
    assert stats["verify_steps"] > 0
    window.close()


class FakeClient(QObject):
    sig_ready = Signal(object)
    sig_loaded = Signal(str, dict)


class FakeWindow(QWidget):
    def __init__(self, config_dir):
        super().__init__()
        self.client = FakeClient(self)
        self.banners = BannerArea(self)
        self.settings_store = SettingsStore(config_dir / "settings.json")
        self.tune_opened = 0

    def open_tune_wizard(self):
        self.tune_opened += 1


def ready(kind: str, name: str) -> Ready:
    return Ready("r", 1, 123, DeviceInfo(kind, name, None, "2.13"))


def start(window: FakeWindow, kind: str) -> None:
    window.client.sig_ready.emit(ready(kind, "NVIDIA H100" if kind == "cuda" else "x86_64"))
    window.client.sig_loaded.emit("load", {})


@pytest.mark.gui
def test_the_first_start_on_a_gpu_offers_the_auto_tune_wizard_once(qtbot, tmp_path):
    window = FakeWindow(tmp_path / "config")
    qtbot.addWidget(window)
    FirstGpuTuneOffer(window)
    start(window, "cuda")
    banner = next(b for b in window.banners._banners if b.key == "first-tune")
    assert "First start on NVIDIA H100: auto-tune" in banner.message
    assert banner.action_buttons[0].text() == "Auto-tune…"
    banner.action_buttons[0].click()
    assert window.tune_opened == 1

    again = FakeWindow(tmp_path / "config")  # the next start of the app
    qtbot.addWidget(again)
    FirstGpuTuneOffer(again)
    start(again, "cuda")
    assert not [b for b in again.banners._banners if b.key == "first-tune"]


@pytest.mark.gui
def test_no_offer_on_a_cpu(qtbot, tmp_path):
    window = FakeWindow(tmp_path / "config")
    qtbot.addWidget(window)
    FirstGpuTuneOffer(window)
    start(window, "cpu")
    assert not [b for b in window.banners._banners if b.key == "first-tune"]
    assert not (tmp_path / "config" / "tune-offered").exists()
