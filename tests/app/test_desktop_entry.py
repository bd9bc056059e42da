"""The Linux desktop entry: the shipped template, the Exec quoting, install and uninstall."""

import configparser
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from app import desktop_entry
from engine.resources import resources_dir


def read_entry(path: Path) -> dict[str, str]:
    parser = configparser.ConfigParser(interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read(path, encoding="utf-8")
    return dict(parser["Desktop Entry"])


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def test_the_shipped_entry_has_the_keys_a_menu_needs():
    entry = read_entry(resources_dir() / desktop_entry.DESKTOP_FILE)
    assert entry["Type"] == "Application" and entry["Name"] == "MoE Chat"
    assert entry["Exec"] == "moe-chat" and entry["Terminal"] == "false"
    assert entry["Icon"] == "moe-chat" and entry["StartupWMClass"] == "moe-chat"
    assert entry["Categories"].endswith(";") and entry["Keywords"].endswith(";")


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (["/opt/moe-chat/moe-chat"], "/opt/moe-chat/moe-chat"),
        (["/opt/moe chat/moe-chat"], '"/opt/moe chat/moe-chat"'),
        # $ is escaped inside the quotes (\$), then the backslash itself (\\$)
        (["/home/a$b/moe-chat", "-m", "app"], '"/home/a\\\\$b/moe-chat" -m app'),
        (["/srv/100%/moe-chat"], "/srv/100%%/moe-chat"),
        (['/it\'s "here"/moe-chat'], '"/it\'s \\\\"here\\\\"/moe-chat"'),
    ],
)
def test_exec_line_quotes_by_the_desktop_entry_rules(command, line):
    assert desktop_entry.exec_line(command) == line


def test_install_writes_the_entry_and_every_icon_size_and_uninstall_removes_them(tmp_path):
    entry_path = desktop_entry.install(tmp_path)
    assert entry_path == tmp_path / "applications" / "moe-chat.desktop"
    entry = read_entry(entry_path)
    assert entry["Exec"] == desktop_entry.exec_line(desktop_entry.launcher())
    assert Path(entry["TryExec"]).is_file()
    assert entry["Name"] == "MoE Chat"  # the rest of the template is kept
    pngs = sorted((tmp_path / "icons" / "hicolor").glob("*x*/apps/moe-chat.png"))
    sizes = {int(p.parts[-3].split("x")[0]) for p in pngs}
    assert {16, 22, 24, 32, 48, 64, 128, 256, 512} <= sizes
    for png in pngs:
        side = int(png.parts[-3].split("x")[0])
        assert png_size(png) == (side, side)
    assert (tmp_path / "icons" / "hicolor" / "scalable" / "apps" / "moe-chat.svg").is_file()

    removed = desktop_entry.uninstall(tmp_path)
    assert len(removed) == len(pngs) + 2
    assert not any(path.is_file() for path in tmp_path.rglob("*"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="desktop entries are Linux's")
def test_the_command_line_reports_a_folder_it_cannot_write(tmp_path):
    (tmp_path / "applications").write_text("a file where the folder should be")
    done = subprocess.run(
        [sys.executable, "-m", "app", "--install-desktop-entry"],
        capture_output=True,
        text=True,
        env={"XDG_DATA_HOME": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.startswith("error: could not write the desktop entry:")


def test_the_window_icon_offers_every_shipped_size(qapp):
    from PySide6.QtCore import QSize

    from app.gui.startup.application import app_icon

    sizes = set(app_icon().availableSizes())
    assert {QSize(side, side) for side in (16, 24, 32, 48, 64, 128, 256, 512)} <= sizes
