"""The live dashboard: the worker's telemetry as numbers and one-minute sparklines.

`Dashboard.update_stats(stats)` takes each `engine.worker.protocol.Stats` event (about
4 Hz while generating, 1 Hz idle) and `set_model(info)` the `Loaded` event's
model dict (None: no model). A figure the worker does not know (no GPU, no
NVML, no model, no speculation) is None in `Stats` and reads "n/a" here; the
dashboard never makes a number up. Whenever the worker reports a simulated
host→device link, a label says so plainly, because every transfer figure is
then a simulation.

Repaints are cheap and never re-layout: every text that changes with the data
is a `StatText` (a painted line whose size does not depend on its text), the
cache occupancy is a painted bar, and the sparklines coalesce their repaints.
Only the simulated-link label is shown or hidden, and only when that changes.
Metric names and meanings follow DESIGN.md "Metric definitions".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PySide6.QtCore import QRectF, QSize, Qt
from PySide6.QtGui import QPainter, QPaintEvent, QPalette
from PySide6.QtWidgets import QFrame, QGridLayout, QLabel, QSizePolicy, QVBoxLayout, QWidget

from app.gui.sparkline import Sparkline
from engine.config import format_bytes
from engine.worker.protocol import Stats

log = logging.getLogger(__name__)

NA = "n/a"
GIB = 1024**3
SIMULATED_TEXT = "SIMULATED LINK — no GPU: transfer figures are simulated"


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

    def show_figures(self, value: str, detail: str = "") -> None:
        self.value.setText(value)
        self.detail.setText(detail)


@dataclass(frozen=True)
class _TileSpec:
    key: str
    title: str
    tooltip: str
    fixed_max: float | None = None
    plot: bool = True


TILES = (
    _TileSpec("vram", "VRAM", "Device memory used / total: NVML for the whole GPU; torch's allocator "
              "(this app's engine) beside it. n/a without a GPU or NVML."),
    _TileSpec("link", "Host → device", "h2d_gbps: bytes the engine copied host→device / wall time over the "
              "last interval (counted exactly). NVML's sampled PCIe receive rate beside it when known."),
    _TileSpec("hit_rate", "Expert hit rate", "Expert uses served from the device cache / all expert uses, "
              "over the last interval; cumulative since the model was loaded below.", fixed_max=1.0),
    _TileSpec("tokens_per_s", "Tokens/s", "1000 / TPOT over the last interval (decode only)."),
    _TileSpec("tpot", "Time per output token", "tpot_ms: decode wall time / generated tokens of the "
              "current reply (prefill excluded)."),
    _TileSpec("accept_len", "Acceptance length", "accept_len: mean tokens emitted per verify step, "
              "including the bonus token. Speculative decoding only."),
    _TileSpec("prefetch", "Prefetch precision / recall", "precision: prefetched experts used before "
              "eviction / prefetched. recall: verify-phase uses that were prefetched / verify-phase uses. "
              "The plot shows recall.", fixed_max=1.0),
    _TileSpec("cutoff", "Cutoff layer", "SP-MoE: the last MoE layer (0-based) whose experts are "
              "prefetched while the draft runs.", plot=False),
    _TileSpec("host_ram", "Host RAM", "This machine's RAM used / total; the engine process's resident "
              "size below."),
)  # fmt: skip


class Dashboard(QWidget):
    """Live figures of the engine: memory, link, cache, speed and speculation."""

    def __init__(self, parent: QWidget | None = None, columns: int = 3):
        super().__init__(parent)
        self._model: dict[str, Any] | None = None
        self._last_time: float | None = None
        self.title = StatText(self, scale=1.1, bold=True)
        self.summary = StatText(self, muted=True)
        self.status = StatText(self, muted=True)
        self.simulated_label = QLabel(SIMULATED_TEXT, self)
        self.simulated_label.setWordWrap(True)
        self.simulated_label.setStyleSheet(
            "QLabel { background: #fff4e5; color: #6b4100; border: 1px solid #e8a317;"
            " border-radius: 3px; padding: 4px 6px; font-weight: bold; }"
        )
        self.simulated_label.setToolTip(
            "This machine has no GPU: the engine runs on the CPU and copies experts over a simulated "
            "host→device link (see Settings). Link speeds and hit-rate effects are those of the simulation."
        )
        self.simulated_label.hide()
        self.tiles = {
            spec.key: MetricTile(spec.title, spec.tooltip, spec.fixed_max, spec.plot) for spec in TILES
        }
        self.cache_title = StatText(self, scale=0.9, muted=True)
        self.cache_title.setText("Expert cache occupancy")
        self.cache_bar = OccupancyBar(self)
        self.cache_bar.setToolTip("Device cache slots holding an expert / all slots.")
        self._build_layout(columns)
        self.set_model(None)

    def _build_layout(self, columns: int) -> None:
        layout = QVBoxLayout(self)
        layout.setContentsMargins(8, 8, 8, 8)
        layout.setSpacing(6)
        for widget in (self.title, self.summary, self.status, self.simulated_label):
            layout.addWidget(widget)
        grid = QGridLayout()
        grid.setSpacing(6)
        for index, tile in enumerate(self.tiles.values()):
            grid.addWidget(tile, index // columns, index % columns)
        for column in range(columns):
            grid.setColumnStretch(column, 1)
        layout.addLayout(grid)
        layout.addWidget(self.cache_title)
        layout.addWidget(self.cache_bar)
        layout.addStretch(1)

    # -- inputs ---------------------------------------------------------------------------------

    def set_model(self, info: dict[str, Any] | None) -> None:
        """The loaded model (the `Loaded` event's dict), or None when no model is loaded."""
        self._model = info
        for tile in self.tiles.values():
            if tile.sparkline is not None:
                tile.sparkline.clear()
        if info is None:
            self.title.setText("No model loaded")
            self.summary.setText("Load a model to see live figures.")
            self.status.setText("idle")
            self._set_simulated(False)
            self._show_empty()
            return
        self.title.setText(info.get("name") or Path(str(info.get("path") or "model")).name)
        self.summary.setText(model_summary(info))
        self._set_simulated(bool(info.get("simulated_link")))

    def update_stats(self, stats: Stats) -> None:
        """Show one telemetry sample; cheap enough for every `Stats` event (no re-layout)."""
        if self._last_time is not None and stats.time_s < self._last_time:  # a new worker, a new clock
            for tile in self.tiles.values():
                if tile.sparkline is not None:
                    tile.sparkline.clear()
        self._last_time = stats.time_s
        self._set_simulated(stats.simulated_link is True)
        if self._model is not None:
            self.status.setText("generating" if stats.generating else "idle")
        self._show_memory(stats)
        self._show_link(stats)
        self._show_hits(stats)
        self._show_speed(stats)
        self._show_speculation(stats)
        self.cache_bar.set_slots(stats.cache_slots_used, stats.cache_slots_total)

    # -- one group of figures each ----------------------------------------------------------------

    def _show_memory(self, s: Stats) -> None:
        torch_part = f"torch allocator {fmt_gib(s.torch_allocated_bytes)}"
        if s.torch_reserved_bytes is not None:
            torch_part += f" (reserved {fmt_gib(s.torch_reserved_bytes)})"
        vram = self.tiles["vram"]
        vram.show_figures(fmt_used_total(s.vram_used_bytes, s.vram_total_bytes), torch_part)
        vram.sparkline.fixed_max = s.vram_total_bytes / GIB if s.vram_total_bytes else None
        vram.sparkline.add(s.time_s, _gib_or_none(s.vram_used_bytes))
        ram = self.tiles["host_ram"]
        ram.show_figures(
            fmt_used_total(s.host_ram_used_bytes, s.host_ram_total_bytes),
            f"engine process {fmt_gib(s.process_rss_bytes)}",
        )
        ram.sparkline.fixed_max = s.host_ram_total_bytes / GIB if s.host_ram_total_bytes else None
        ram.sparkline.add(s.time_s, _gib_or_none(s.host_ram_used_bytes))

    def _show_link(self, s: Stats) -> None:
        link = self.tiles["link"]
        link.title.setText("Host → device (simulated)" if s.simulated_link else "Host → device")
        parts = []
        if s.pcie_rx_gbps is not None:
            parts.append(f"NVML PCIe rx {fmt_gbps(s.pcie_rx_gbps)}")
        elif s.simulated_link:
            parts.append("counted on the simulated link")
        if s.simulated_link is not None:
            parts.append(f"{format_bytes(s.h2d_bytes)} copied")
        link.show_figures(fmt_gbps(s.h2d_gbps), " · ".join(parts))
        link.sparkline.add(s.time_s, s.h2d_gbps)

    def _show_hits(self, s: Stats) -> None:
        tile = self.tiles["hit_rate"]
        detail = f"cumulative {fmt_percent(s.hit_rate_total)}"
        if s.hits or s.misses:
            detail += f" · {s.hits:,} hits / {s.misses:,} misses"
        tile.show_figures(fmt_percent(s.hit_rate), detail)
        tile.sparkline.add(s.time_s, s.hit_rate)

    def _show_speed(self, s: Stats) -> None:
        state = "generating" if s.generating else "idle"
        tokens = self.tiles["tokens_per_s"]
        tokens.show_figures(fmt_number(s.tokens_per_s, "tok/s"), f"{state} · {s.generated_tokens:,} tokens")
        tokens.sparkline.add(s.time_s, s.tokens_per_s)
        tpot = self.tiles["tpot"]
        tpot.show_figures(fmt_number(s.tpot_ms, "ms"), "decode time per token")
        tpot.sparkline.add(s.time_s, s.tpot_ms)

    def _show_speculation(self, s: Stats) -> None:
        accept = self.tiles["accept_len"]
        accept.show_figures(fmt_number(s.accept_len, "tokens", 2), "per verify step, bonus included")
        accept.sparkline.add(s.time_s, s.accept_len)
        prefetch = self.tiles["prefetch"]
        prefetch.show_figures(
            f"{fmt_percent(s.prefetch_precision)} / {fmt_percent(s.prefetch_recall)}", "precision / recall"
        )
        prefetch.sparkline.add(s.time_s, s.prefetch_recall)
        moe_layers = (self._model or {}).get("moe_layers")
        of = f" of 0–{moe_layers - 1}" if isinstance(moe_layers, int) and moe_layers > 0 else ""
        detail = f"last MoE layer prefetched{of}" if s.cutoff_layer is not None else "no SP-MoE prefetch"
        self.tiles["cutoff"].show_figures(fmt_number(s.cutoff_layer, digits=0), detail)

    def _show_empty(self) -> None:
        for tile in self.tiles.values():
            tile.show_figures(NA)
        self.tiles["link"].title.setText("Host → device")
        self.cache_bar.set_slots(None, None)

    def _set_simulated(self, simulated: bool) -> None:
        if simulated != self.simulated_label.isVisibleTo(self):
            self.simulated_label.setVisible(simulated)

    def is_simulated_shown(self) -> bool:
        """Whether the simulated-link label is shown (tests; the widget may itself be hidden)."""
        return self.simulated_label.isVisibleTo(self)


def _gib_or_none(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / GIB
