"""Banners: stacking, replace-by-key, actions, close, clear, timeout."""

import pytest
from PySide6.QtCore import Qt

from app.gui.widgets.banner import BannerArea
from tests.screenshots import save_screenshot

pytestmark = pytest.mark.gui


@pytest.fixture
def area(qtbot):
    widget = BannerArea()
    qtbot.addWidget(widget)
    widget.resize(640, 200)
    return widget


def test_banners_stack_in_order_and_the_area_hides_when_empty(area):
    assert area.banners() == [] and area.isHidden()
    first = area.show_banner("The engine stopped.", "error")
    second = area.show_banner("Low disk space.", "warning")
    assert area.banners() == [first, second] and not area.isHidden()
    assert (second.kind, second.label.text()) == ("warning", "Low disk space.")
    first.close_button.click()
    assert area.banners() == [second]
    second.close_banner()
    assert area.banners() == [] and area.isHidden()


def test_the_same_key_replaces_the_banner_in_place(area):
    top = area.show_banner("Download failed.", "error", key="download")
    below = area.show_banner("Model loaded.", "info")
    replacement = area.show_banner("Download failed again.", "error", key="download")
    assert area.banners() == [replacement, below]
    assert top.closed and not replacement.closed
    assert area.layout().indexOf(replacement) == 0 and area.layout().indexOf(top) == -1


def test_an_action_closes_the_banner_then_runs_its_callback(qtbot, area):
    calls = []

    def restart():
        calls.append(area.banners())  # the banner is gone by the time the callback runs
        area.show_banner("Restarting the engine…", "info", key="engine")

    area.show_banner(
        "The engine stopped.", "error", [("Restart", restart), ("Details", lambda: None)], key="engine"
    )
    banner = area.banners()[0]
    assert [b.text() for b in banner.action_buttons] == ["Restart", "Details"]
    qtbot.mouseClick(banner.action_buttons[0], Qt.MouseButton.LeftButton)
    assert calls == [[]]
    assert [b.label.text() for b in area.banners()] == ["Restarting the engine…"]


def test_clear_by_key_or_all(area):
    area.show_banner("a", key="a")
    b = area.show_banner("b", "info", key="b")
    area.show_banner("c", "warning")
    area.clear("a")
    assert [x.key for x in area.banners()] == ["b", None]
    area.clear("nothing-shown")
    assert len(area.banners()) == 2
    area.clear()
    assert area.banners() == [] and b.closed


def test_a_timeout_closes_the_banner_but_not_its_replacement(qtbot, area):
    area.show_banner("Saved.", "info", key="saved", timeout_ms=50)
    qtbot.waitUntil(lambda: area.banners() == [], timeout=2000)
    area.show_banner("Old.", "info", key="k", timeout_ms=50)
    new = area.show_banner("New.", "info", key="k")
    qtbot.wait(150)
    assert area.banners() == [new]


def test_an_unknown_kind_is_refused(area):
    with pytest.raises(ValueError, match="banner kind"):
        area.show_banner("?", "fatal")


def test_screenshot(qtbot, area, tmp_path):
    area.show_banner("The engine stopped unexpectedly (exit code -9).", "error", [("Restart", lambda: None)])
    area.show_banner("Only 3.1 GiB free on the disk holding the model cache.", "warning")
    area.show_banner("Simulated link: no GPU was found.", "info")
    area.show()
    qtbot.waitExposed(area)
    area.resize(640, area.heightForWidth(640))  # a window's top area is as tall as its banners
    qtbot.wait(20)
    save_screenshot(area, "banners.png", tmp_path)
