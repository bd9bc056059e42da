"""`moe-chat --install-desktop-entry`: put MoE Chat in a Linux desktop's application menu.

Writes `resources/moe-chat.desktop` to `$XDG_DATA_HOME/applications/` (default
`~/.local/share`) with `Exec` and `TryExec` set to this executable's absolute path (the
bundle's `moe-chat`, or the one pip installed), and copies the icons into the hicolor
theme there (`icons/hicolor/<N>x<N>/apps/moe-chat.png` and `scalable/apps/moe-chat.svg`).
The user's own copy is replaced; nothing outside the user's data folder is touched.
`--uninstall-desktop-entry` removes those files again.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

from engine.resources import resources_dir

DESKTOP_FILE = "moe-chat.desktop"
RESERVED = set(" \t\n\"'\\><~|&;$*?#()`")  # Exec arguments with these must be quoted


def data_home() -> Path:
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")


def launcher() -> list[str]:
    """The command that starts this installation's window."""
    if getattr(sys, "frozen", False):
        return [str(Path(sys.executable).resolve())]
    found = shutil.which("moe-chat")
    if found:
        return [str(Path(found).resolve())]
    return [str(Path(sys.executable).resolve()), "-m", "app"]


def exec_line(command: list[str]) -> str:
    """`command` as a desktop entry's Exec value: reserved characters put an argument in double
    quotes (escaping ", `, $ and \\ inside), % is doubled, then backslashes are escaped once more
    (the Desktop Entry Specification's string rule, applied before its quoting rule)."""
    return " ".join(_string_value(_quote(arg)) for arg in command)


def _quote(arg: str) -> str:
    if not arg or any(char in RESERVED for char in arg):
        arg = '"' + re.sub(r'(["`$\\])', r"\\\1", arg) + '"'
    return arg.replace("%", "%%")


def _string_value(text: str) -> str:
    return text.replace("\\", "\\\\")


def installed_files(home: Path | None = None) -> list[Path]:
    """Every file `install` writes: the entry, then the icons."""
    home = home or data_home()
    icons = resources_dir() / "icons"
    files = [home / "applications" / DESKTOP_FILE]
    for png in sorted(icons.glob("moe-chat-*.png")):
        size = png.stem.rsplit("-", 1)[1]
        files.append(home / "icons" / "hicolor" / f"{size}x{size}" / "apps" / "moe-chat.png")
    files.append(home / "icons" / "hicolor" / "scalable" / "apps" / "moe-chat.svg")
    return files


def install(home: Path | None = None) -> Path:
    """Write the entry and the icons; the entry's path. Raises OSError (a read-only or full disk)."""
    home = home or data_home()
    icons = resources_dir() / "icons"
    command = launcher()
    template = (resources_dir() / DESKTOP_FILE).read_text(encoding="utf-8")
    entry = re.sub(r"(?m)^Exec=.*$", lambda _: f"Exec={exec_line(command)}", template)
    entry = re.sub(r"(?m)^TryExec=.*$", lambda _: f"TryExec={_string_value(command[0])}", entry)
    sources = [*sorted(icons.glob("moe-chat-*.png")), icons / "moe-chat.svg"]
    desktop, *icon_targets = installed_files(home)
    for source, target in zip(sources, icon_targets, strict=True):
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
    desktop.parent.mkdir(parents=True, exist_ok=True)
    partial = desktop.with_suffix(".partial")
    partial.write_text(entry, encoding="utf-8")
    partial.replace(desktop)
    return desktop


def uninstall(home: Path | None = None) -> list[Path]:
    """Remove what `install` wrote; the files that were there."""
    removed = []
    for path in installed_files(home):
        if path.exists():
            path.unlink()
            removed.append(path)
    return removed
