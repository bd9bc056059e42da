"""packaging/build.py's report of the Qt X11 libraries a bundle does not carry (no build here)."""

import importlib.util
import sys
from pathlib import Path

import pytest

from app.gui.startup.system_libs import XCB_LIBRARIES

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "packaging" / "build.py"
_spec = importlib.util.spec_from_file_location("moe_chat_build", BUILD_SCRIPT)
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="X11 libraries are a Linux matter")
def test_the_report_names_the_packages_of_the_libraries_the_bundle_lacks(tmp_path):
    libs = tmp_path / "moe-chat" / "_internal"
    libs.mkdir(parents=True)
    for soname in XCB_LIBRARIES:
        if soname not in ("libxcb-icccm.so.4", "libxcb-keysyms.so.1"):
            (libs / soname).write_bytes(b"")
    assert build.xcb_packages_not_carried(tmp_path / "moe-chat") == ["libxcb-icccm4", "libxcb-keysyms1"]
