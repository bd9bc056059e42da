"""The start's check of the libraries Qt's X11 plugin loads, with a fake library lookup."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from app.gui.startup import system_libs
from app.gui.startup.system_libs import XCB_LIBRARIES, missing_xcb_packages, qt_platform, qt_platform_problem

BARE_DEBIAN = {"libxcb-cursor.so.0", "libxcb-icccm.so.4", "libxcb-keysyms.so.1"}  # what a bare system lacks


def lookup_without(missing: set[str]):
    return lambda name: Path(name).name not in missing


@pytest.mark.parametrize(
    ("env", "args", "platform"),
    [
        ({}, [], "xcb"),
        ({"WAYLAND_DISPLAY": "wayland-0"}, [], "wayland"),
        ({"QT_QPA_PLATFORM": "offscreen"}, [], "offscreen"),
        ({"QT_QPA_PLATFORM": "wayland;xcb", "DISPLAY": ":0"}, [], "wayland"),
        ({"QT_QPA_PLATFORM": "xcb", "WAYLAND_DISPLAY": "wayland-0"}, [], "xcb"),
        ({"QT_QPA_PLATFORM": "vnc:size=800x600"}, [], "vnc"),
        ({"QT_QPA_PLATFORM": "xcb"}, ["-platform", "offscreen"], "offscreen"),
    ],
)
def test_the_platform_is_the_one_qt_tries_first(env, args, platform):
    assert qt_platform(env, args) == platform


def test_missing_libraries_are_named_by_their_apt_packages_in_one_line():
    line = qt_platform_problem(env={"DISPLAY": ":0"}, platform="linux", load=lookup_without(BARE_DEBIAN))
    assert line is not None and "\n" not in line
    assert line.endswith("sudo apt install libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1")


@pytest.mark.parametrize(
    ("env", "platform"),
    [
        ({"QT_QPA_PLATFORM": "offscreen"}, "linux"),
        ({"WAYLAND_DISPLAY": "wayland-0"}, "linux"),
        ({"QT_QPA_PLATFORM": "wayland"}, "linux"),
        ({}, "win32"),
        ({}, "darwin"),
    ],
)
def test_no_false_alarm_where_qt_does_not_use_xcb(env, platform):
    assert qt_platform_problem(env=env, platform=platform, load=lambda name: False) is None


def test_a_complete_system_passes():
    assert qt_platform_problem(env={}, platform="linux", load=lambda name: True) is None


def test_a_library_the_bundle_carries_counts_as_present(tmp_path):
    (tmp_path / "libxcb-cursor.so.0").write_bytes(b"")
    loads_only_bundled = lambda name: name not in XCB_LIBRARIES  # noqa: E731  the system has none of them
    missing = missing_xcb_packages(loads_only_bundled, [tmp_path])
    assert "libxcb-cursor0" not in missing and "libxcb-icccm4" in missing


def test_moe_chat_says_it_in_one_line_instead_of_qt_abort(monkeypatch, capsys):
    from app import main

    monkeypatch.setattr(system_libs, "can_load", lookup_without(BARE_DEBIAN))
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setenv("QT_QPA_PLATFORM", "xcb")
    root = logging.getLogger()
    before = root.handlers[:]
    # main() sets up the app's logging: its console handler writes to this test's captured stderr,
    # which later tests must not inherit (they would log into a closed stream)
    monkeypatch.setattr(root, "handlers", root.handlers[:])
    monkeypatch.setattr(root, "level", root.level)
    try:
        assert main.main([]) == 1
    finally:
        for handler in root.handlers:
            if handler not in before:
                handler.close()
    assert capsys.readouterr().err.strip().endswith("libxcb-cursor0 libxcb-icccm4 libxcb-keysyms1")


def test_the_real_lookup_agrees_with_the_dynamic_loader():
    """On this machine: whatever `can_load` says about libc and a made-up name is what dlopen says."""
    assert system_libs.can_load("libc.so.6") == sys.platform.startswith("linux")
    assert not system_libs.can_load("libmoe-chat-does-not-exist.so.0")


def test_the_check_does_not_import_qt():
    code = "import sys, app.gui.startup.system_libs; print('PySide6' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_readme_names_every_package_the_check_may_ask_for():
    readme = (Path(__file__).resolve().parents[4] / "README.md").read_text()
    assert all(f" {package}" in readme for package in XCB_LIBRARIES.values())
