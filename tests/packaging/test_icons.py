"""The committed icons: every size each platform asks for, in its own container format."""

import struct
from pathlib import Path

import pytest

from engine.resources import resources_dir

ICONS = resources_dir() / "icons"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ICNS_PNG_SIDES = {b"ic07": 128, b"ic08": 256, b"ic09": 512, b"ic10": 1024, b"ic11": 32, b"ic12": 64}


def png_side(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("side", [16, 22, 24, 32, 48, 64, 128, 256, 512])
def test_linux_and_qt_pngs(side):
    assert png_side((ICONS / f"moe-chat-{side}.png").read_bytes()) == (side, side)


def test_windows_ico_holds_16_to_256_pixels():
    data = (ICONS / "moe-chat.ico").read_bytes()
    reserved, kind, count = struct.unpack("<HHH", data[:6])
    assert (reserved, kind) == (0, 1)
    sides = set()
    for i in range(count):
        width, height = data[6 + 16 * i], data[7 + 16 * i]
        assert width == height
        sides.add(width or 256)  # 0 stands for 256
    assert {16, 20, 24, 32, 40, 48, 64, 256} <= sides


def test_macos_icns_holds_128_to_1024_pixels_and_retina_variants():
    data = (ICONS / "moe-chat.icns").read_bytes()
    assert data[:4] == b"icns" and struct.unpack(">I", data[4:8])[0] == len(data)
    found = {}
    offset = 8
    while offset < len(data):
        kind, length = data[offset : offset + 4], struct.unpack(">I", data[offset + 4 : offset + 8])[0]
        if kind in ICNS_PNG_SIDES:
            found[kind] = png_side(data[offset + 8 : offset + length])[0]
        offset += length
    assert found == ICNS_PNG_SIDES


def test_the_svg_source_is_shipped():
    assert (ICONS / "moe-chat.svg").read_text().lstrip().startswith("<svg")
    assert Path(ICONS / "moe-chat.svg").stat().st_size < 4096  # a hand-written drawing
