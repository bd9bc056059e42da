"""Render `resources/icons/moe-chat.svg` into the icon files each platform wants.

    python packaging/make_icons.py

Writes, beside the SVG:

- `moe-chat-<N>.png` for N in `PNG_SIZES`: the Linux hicolor theme sizes (the `.desktop`
  entry's icon) and the sizes Qt picks from for the window and taskbar icon;
- `moe-chat.ico` (Windows: 16–256 px in one file, what PyInstaller embeds in the .exe);
- `moe-chat.icns` (macOS: 16–1024 px, the app bundle's icon).

Qt renders the SVG (so the PNGs match what the app draws); Pillow writes the .ico and
.icns containers. Run it after changing the SVG and commit the results: the build does
not need Qt's SVG module or Pillow to be installed.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

ICONS = Path(__file__).resolve().parents[1] / "resources" / "icons"
SVG = ICONS / "moe-chat.svg"
PNG_SIZES = (16, 22, 24, 32, 48, 64, 128, 256, 512)
ICO_SIZES = (16, 20, 24, 32, 40, 48, 64, 256)  # Windows shell sizes at 100–250 % scaling
ICNS_SIZES = (16, 32, 64, 128, 256, 512, 1024)


def render(size: int) -> bytes:
    """The SVG drawn at `size`×`size` pixels, as PNG bytes."""
    from PySide6.QtCore import QBuffer, QIODevice, Qt
    from PySide6.QtGui import QImage, QPainter
    from PySide6.QtSvg import QSvgRenderer

    renderer = QSvgRenderer(str(SVG))
    if not renderer.isValid():
        raise SystemExit(f"{SVG} is not a valid SVG")
    image = QImage(size, size, QImage.Format.Format_ARGB32_Premultiplied)
    image.fill(Qt.GlobalColor.transparent)
    painter = QPainter(image)
    painter.setRenderHint(QPainter.RenderHint.Antialiasing)
    renderer.render(painter)
    painter.end()
    buffer = QBuffer()
    buffer.open(QIODevice.OpenModeFlag.WriteOnly)
    image.save(buffer, "PNG")
    return bytes(buffer.data())


def main() -> int:
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    from PIL import Image
    from PySide6.QtGui import QGuiApplication

    app = QGuiApplication.instance() or QGuiApplication(sys.argv[:1])  # noqa: F841 (QImage needs one)
    pngs = {size: render(size) for size in sorted({*PNG_SIZES, *ICO_SIZES, *ICNS_SIZES})}
    for size in PNG_SIZES:
        (ICONS / f"moe-chat-{size}.png").write_bytes(pngs[size])
    largest = Image.open(io.BytesIO(pngs[max(ICO_SIZES)]))
    largest.save(
        ICONS / "moe-chat.ico",
        sizes=[(size, size) for size in ICO_SIZES],
        append_images=[Image.open(io.BytesIO(pngs[size])) for size in ICO_SIZES],
    )
    Image.open(io.BytesIO(pngs[1024])).save(
        ICONS / "moe-chat.icns",
        append_images=[Image.open(io.BytesIO(pngs[size])) for size in ICNS_SIZES],
    )
    print(f"wrote {len(PNG_SIZES)} PNGs, moe-chat.ico and moe-chat.icns to {ICONS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
