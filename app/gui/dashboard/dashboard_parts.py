"""The dashboard's pieces: pure formatting of figures, painted text lines, the cache bar, metric tiles.

Every piece here is cheap to update and never re-layouts: a `StatText` is a
painted line whose size does not depend on its text, the `OccupancyBar` paints
its figures on itself, and a `MetricTile` only changes what these show. A tile
can be greyed (`set_muted`) when its figures are not live: the last reply's, or
a stopped engine's. `TILES` lists the figures, their titles and tooltips
(metric names as in DESIGN.md "Metric definitions").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import QFrame, QSizePolicy, QVBoxLayout, QWidget

from app.gui.dashboard.sparkline import Sparkline

NA = "n/a"
GIB = 1024**3


# ---- formatting (pure) ---------------------------------------------------------------------------


def fmt_gib(nbytes: int | None) -> str:
    return NA if nbytes is None else f"{nbytes / GIB:.1f} GiB"


def fmt_used_total(used: int | None, total: int | None) -> str:
    """'12.3 / 24.0 GiB'; 'n/a' when the used figure is unknown."""
    if used is None:
        return NA
    if total is None:
        return fmt_gib(used)
    return f"{used / GIB:.1f} / {total / GIB:.1f} GiB"


def fmt_gbps(gbps: float | None) -> str:
    if gbps is None:
        return NA
    return f"{gbps:.2f} GB/s" if gbps < 10 else f"{gbps:.1f} GB/s"


def fmt_percent(fraction: float | None) -> str:
    return NA if fraction is None else f"{fraction * 100:.1f} %"


def fmt_number(value: float | None, unit: str = "", digits: int = 1) -> str:
    if value is None:
        return NA
    return f"{value:.{digits}f}{' ' + unit if unit else ''}"


def model_summary(info: dict[str, Any]) -> str:
    """One line about the loaded model from the Loaded event's dict; parts it lacks are left out."""
    if info.get("remote"):  # a remote engine's model: where it is served, what the server says of it
        context = f"context {info['max_model_len']:,}" if info.get("max_model_len") else ""
        return " · ".join(p for p in (f"served by {info.get('base_url')}", context) if p)
    parts = []
    if info.get("model_type"):
        parts.append(str(info["model_type"]))
    if info.get("moe_layers") is not None and info.get("num_experts") is not None:
        top_k = f" (top-{info['top_k']})" if info.get("top_k") is not None else ""
        parts.append(f"{info['moe_layers']} MoE layers × {info['num_experts']} experts{top_k}")
    if info.get("cache_slots") is not None:
        parts.append(f"{info['cache_slots']} cache slots")
    if info.get("device"):
        parts.append(str(info["device"]))
    if info.get("expert_dtype"):
        parts.append(f"experts {info['expert_dtype']}")
    if info.get("kernels") == "ggml":  # llama.cpp's; the exact kernels go unsaid, as before
        parts.append("ggml kernels")
    return " · ".join(parts)


# ---- painted pieces --------------------------------------------------------------------------------


class StatText(QWidget):
    """One line of text, elided to fit; setting it repaints but never changes the widget's size."""

    def __init__(
        self, parent: QWidget | None = None, scale: float = 1.0, bold: bool = False, muted: bool = False
    ):
        super().__init__(parent)
        font = self.font()
        font.setPointSizeF(font.pointSizeF() * scale)
        font.setBold(bold)
        self.setFont(font)
        self._text = ""
        self._muted = muted
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(self.fontMetrics().height() + 2)

    def sizeHint(self) -> QSize:
        return QSize(self.fontMetrics().horizontalAdvance("0" * 16), self.height())

    def minimumSizeHint(self) -> QSize:
        return QSize(self.fontMetrics().horizontalAdvance("0" * 6), self.height())

    def text(self) -> str:
        return self._text

    def setText(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self.update()

    def set_muted(self, muted: bool) -> None:
        """Grey (the palette's placeholder colour) or the normal text colour."""
        if muted != self._muted:
            self._muted = muted
            self.update()

    def is_muted(self) -> bool:
        return self._muted

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        role = QPalette.ColorRole.PlaceholderText if self._muted else QPalette.ColorRole.WindowText
        painter.setPen(self.palette().color(role))
        shown = self.fontMetrics().elidedText(self._text, Qt.TextElideMode.ElideRight, self.width())
        painter.drawText(self.rect(), int(Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter), shown)
        painter.end()


class OccupancyBar(QWidget):
    """Expert cache slots used out of the total, as a filled bar with the figures on it."""

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self._used: int | None = None
        self._total: int | None = None
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(self.fontMetrics().height() + 8)

    def sizeHint(self) -> QSize:
        return QSize(200, self.height())

    def set_slots(self, used: int | None, total: int | None) -> None:
        if (used, total) != (self._used, self._total):
            self._used, self._total = used, total
            self.update()

    def text(self) -> str:
        if self._used is None or not self._total:
            return NA
        return f"{self._used} / {self._total} slots · {self._used / self._total * 100:.0f} %"

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        palette = self.palette()
        outline = QRectF(self.rect()).adjusted(0.5, 0.5, -0.5, -0.5)
        painter.setPen(palette.color(QPalette.ColorRole.Mid))
        painter.setBrush(palette.color(QPalette.ColorRole.Base))
        painter.drawRoundedRect(outline, 3, 3)
        if self._used is not None and self._total:
            fill = QRectF(outline)
            fill.setWidth(outline.width() * min(self._used / self._total, 1.0))
            painter.setPen(Qt.PenStyle.NoPen)
            color = palette.color(QPalette.ColorRole.Highlight)
            color.setAlpha(110)
            painter.setBrush(color)
            painter.drawRoundedRect(fill, 3, 3)
        painter.setPen(palette.color(QPalette.ColorRole.Text))
        painter.drawText(self.rect(), int(Qt.AlignmentFlag.AlignCenter), self.text())
        painter.end()


class MetricTile(QFrame):
    """A titled figure: the value, a detail line under it and, optionally, its sparkline."""

    def __init__(self, title: str, tooltip: str, fixed_max: float | None = None, plot: bool = True):
        super().__init__()
        self.setFrameShape(QFrame.Shape.StyledPanel)
        self.setToolTip(tooltip)
        self.title = StatText(self, scale=0.9, muted=True)
        self.title.setText(title)
        self.value = StatText(self, scale=1.35, bold=True)
        self.detail = StatText(self, scale=0.9, muted=True)
        self.sparkline = Sparkline(self, fixed_max=fixed_max) if plot else None
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 6, 8, 6)
        layout.setSpacing(2)
        for widget in (self.title, self.value, self.detail, self.sparkline):
            if widget is not None:
                layout.addWidget(widget)
        layout.addStretch(1)  # a tile without a plot keeps its lines together at the top

    def show_figures(self, value: str, detail: str = "", muted: bool = False) -> None:
        """Show the figures; `muted` greys the value (not live: the last reply's, a stopped engine's)."""
        self.value.setText(value)
        self.value.set_muted(muted)
        self.detail.setText(detail)
        if self.sparkline is not None:
            self.sparkline.set_muted(muted)


@dataclass(frozen=True)
class _TileSpec:
    key: str
    title: str
    tooltip: str
    fixed_max: float | None = None
    plot: bool = True


TILES = (
    _TileSpec("vram", "VRAM", "GPU memory in use / the card's total (the whole GPU, as the NVIDIA "
              "driver reports it); this app's engine's share beside it. n/a without an NVIDIA GPU."),
    _TileSpec("link", "Host → device", "How fast experts are copied from RAM to the GPU: bytes copied "
              "over the last moment, counted exactly; the driver's measured PCIe receive rate beside "
              "it where the card reports one."),
    _TileSpec("hit_rate", "Expert hit rate", "Of the experts the model used over the last moment, the "
              "share already on the GPU (no copy needed); since the model was loaded below.", fixed_max=1.0),
    _TileSpec("tokens_per_s", "Tokens/s", "How fast the reply is written (after the prompt is read)."),
    _TileSpec("tpot", "Time per token", "The time each new token of the current reply takes, the "
              "prompt's reading left out."),
    _TileSpec("accept_len", "Acceptance length", "Speculative decoding: the tokens each check of the "
              "drafter's guesses keeps on average, the model's own next token included."),
    _TileSpec("prefetch", "Prefetch precision / recall", "Experts brought to the GPU ahead of need: "
              "precision, the share used before they were evicted; recall, the share of the experts "
              "verification used that were already there. The plot shows recall.", fixed_max=1.0),
    _TileSpec("cutoff", "Cutoff layer", "SP-MoE: the deepest MoE layer whose experts are brought in "
              "while the drafter writes its guesses.", plot=False),
    _TileSpec("host_ram", "Host RAM", "This computer's RAM in use / total; the engine process's share "
              "below."),
)  # fmt: skip
