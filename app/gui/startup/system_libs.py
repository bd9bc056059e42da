"""Before the window: are the system libraries there that Qt's X11 platform plugin loads?

On Linux, Qt draws through a platform plugin. The X11 one (`xcb`) loads about twenty
system libraries; a bare Debian or Ubuntu lacks a few of them (libxcb-cursor0,
libxcb-icccm4, libxcb-keysyms1 …), and Qt then aborts with a long message about
plugins that names none of the packages. `qt_platform_problem` predicts that: when Qt
would use `xcb` and a library cannot be loaded, it returns one line naming the apt
packages to install. It stays quiet where Qt would not use `xcb` (offscreen, Wayland,
another platform asked for) and off Linux.

A frozen bundle (PyInstaller) carries the libraries its build machine had; the check
looks there too, so it only names what neither the bundle nor the system has.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

# what libQt6XcbQpa (PySide6 6.8–6.11) links, by soname, and the Debian/Ubuntu package of each
XCB_LIBRARIES = {
    "libxcb-cursor.so.0": "libxcb-cursor0",
    "libxcb-icccm.so.4": "libxcb-icccm4",
    "libxcb-keysyms.so.1": "libxcb-keysyms1",
    "libxcb-image.so.0": "libxcb-image0",
    "libxcb-render-util.so.0": "libxcb-render-util0",
    "libxcb-util.so.1": "libxcb-util1",
    "libxcb-randr.so.0": "libxcb-randr0",
    "libxcb-shape.so.0": "libxcb-shape0",
    "libxcb-shm.so.0": "libxcb-shm0",
    "libxcb-sync.so.1": "libxcb-sync1",
    "libxcb-xfixes.so.0": "libxcb-xfixes0",
    "libxcb-render.so.0": "libxcb-render0",
    "libxcb-xkb.so.1": "libxcb-xkb1",
    "libxcb.so.1": "libxcb1",
    "libX11-xcb.so.1": "libx11-xcb1",
    "libxkbcommon-x11.so.0": "libxkbcommon-x11-0",
    "libxkbcommon.so.0": "libxkbcommon0",
    "libEGL.so.1": "libegl1",
    "libGL.so.1": "libgl1",
    "libfontconfig.so.1": "libfontconfig1",
    "libdbus-1.so.3": "libdbus-1-3",
}

Loader = Callable[[str], bool]  # can this library (a soname or a path) be loaded?


def can_load(name: str) -> bool:
    try:
        ctypes.CDLL(name)
    except OSError:
        return False
    return True


def qt_platform(env: Mapping[str, str], qt_args: Sequence[str] = ()) -> str:
    """The platform plugin Qt will try first: `-platform` in the arguments, QT_QPA_PLATFORM, or on
    Linux `wayland` in a Wayland session and else `xcb` (Qt 6's own order)."""
    args = list(qt_args)
    for flag in ("-platform", "--platform"):
        if flag in args[:-1]:
            return args[args.index(flag) + 1].split(";")[0].split(":")[0]
    asked = env.get("QT_QPA_PLATFORM", "").strip()
    if asked:
        return asked.split(";")[0].split(":")[0]
    return "wayland" if env.get("WAYLAND_DISPLAY") else "xcb"


def missing_xcb_packages(load: Loader | None = None, bundle_dirs: Sequence[Path] = ()) -> list[str]:
    """The apt packages of the xcb plugin's libraries that neither the system nor the bundle has."""
    load = load or can_load
    missing = []
    for soname, package in XCB_LIBRARIES.items():
        bundled = [folder / soname for folder in bundle_dirs if (folder / soname).is_file()]
        if not load(soname) and not any(load(str(path)) for path in bundled):
            missing.append(package)
    return missing


def qt_platform_problem(
    qt_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    platform: str | None = None,
    load: Loader | None = None,
) -> str | None:
    """One line saying which packages to install when Qt's xcb plugin cannot load; None when fine."""
    env = os.environ if env is None else env
    if not (platform or sys.platform).startswith("linux") or qt_platform(env, qt_args) != "xcb":
        return None
    missing = missing_xcb_packages(load, _bundle_dirs())
    if not missing:
        return None
    return (
        f"MoE Chat's window needs system libraries that Qt's X11 support loads; install them with: "
        f"sudo apt install {' '.join(missing)}"
    )


def _bundle_dirs() -> list[Path]:
    """Where a PyInstaller bundle keeps shared libraries (none outside a bundle)."""
    root = getattr(sys, "_MEIPASS", None)
    if not getattr(sys, "frozen", False) or root is None:
        return []
    return [Path(root), Path(root) / "PySide6" / "Qt" / "lib"]
