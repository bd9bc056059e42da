"""The tuning result plot: measured vs predicted TPOT against the prefetch cutoff layer.

`TuneCurvePlot` is a QWidget drawn with QPainter (no QtCharts): measured TPOT per draft
length as solid lines with dots, the engine's prediction dashed on the same axes, plain
decoding in grey, and a legend beside the plot. `set_data(measured, predicted)` takes the
curve points as plain dicts (cutoff_layer, draft_len, tpot_ms). The pure helpers
`series_by_draft_len`, `nice_ticks` and `axis_ranges` group the points and lay out the axes.
"""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

SERIES_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b")
PLAIN_COLOR = "#555555"


def series_by_draft_len(points: list[dict[str, Any]]) -> dict[int, list[tuple[int, float]]]:
    """Curve points grouped by draft length, each group as (cutoff layer, TPOT ms) sorted by cutoff."""
    groups: dict[int, list[tuple[int, float]]] = {}
    for point in points:
        groups.setdefault(int(point["draft_len"]), []).append(
            (int(point["cutoff_layer"]), float(point["tpot_ms"]))
        )
    return {draft_len: sorted(group) for draft_len, group in sorted(groups.items())}


def nice_ticks(low: float, high: float, count: int = 6) -> list[float]:
    """Round tick values (1, 2, 2.5 or 5 × 10^n apart) covering [low, high]; about `count` of them."""
    if not high > low:
        high = low + 1.0
    raw = (high - low) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(low / step) * step
    ticks = []
    value = first
    while value <= high + step * 1e-9:
        ticks.append(round(value, 10))
        value += step
    if ticks[-1] < high:
        ticks.append(round(value, 10))
    return ticks


def axis_ranges(
    measured: list[dict[str, Any]], predicted: list[dict[str, Any]]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """((x_min, x_max), (y_min, y_max)) for the plot: every cutoff layer, and TPOT from round ticks.

    x spans the cutoff layers of both series, half a layer of margin each side; y spans the
    TPOT values rounded out to ticks. Empty data gives (-1, 1) × (0, 1)."""
    points = measured + predicted
    if not points:
        return (-1.5, 1.5), (0.0, 1.0)
    cutoffs = [int(p["cutoff_layer"]) for p in points]
    tpots = [float(p["tpot_ms"]) for p in points]
    ticks = nice_ticks(min(tpots), max(tpots))
    return (min(cutoffs) - 0.5, max(cutoffs) + 0.5), (ticks[0], ticks[-1])


class TuneCurvePlot(QWidget):
    """Measured TPOT (solid, dots) and predicted TPOT (dashed) against the prefetch cutoff layer."""

    MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 62, 120, 14, 46

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMinimumSize(460, 240)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self._measured: dict[int, list[tuple[int, float]]] = {}
        self._predicted: dict[int, list[tuple[int, float]]] = {}
        self._ranges = axis_ranges([], [])

    def set_data(self, measured: list[dict[str, Any]], predicted: list[dict[str, Any]]) -> None:
        """Plot these curve points (dicts with cutoff_layer, draft_len, tpot_ms); prediction only for
        the draft lengths that were measured."""
        self._measured = series_by_draft_len(measured)
        kept = [p for p in predicted if int(p["draft_len"]) in self._measured]
        self._predicted = series_by_draft_len(kept)
        self._ranges = axis_ranges(measured, kept)
        self.update()

    def series_color(self, draft_len: int) -> QColor:
        """The colour of one draft length's lines (grey for plain decoding)."""
        if draft_len == 0:
            return QColor(PLAIN_COLOR)
        index = (
            sorted(d for d in self._measured if d > 0).index(draft_len) if draft_len in self._measured else 0
        )
        return QColor(SERIES_COLORS[index % len(SERIES_COLORS)])

    def _plot_rect(self) -> QRectF:
        metrics = self.fontMetrics()
        legend = max((metrics.horizontalAdvance(label) for label, _, _ in self.legend_entries()), default=0)
        right = max(self.MARGIN_RIGHT, legend + 28 + 12 + 10)  # swatch, gaps: the legend never clips
        return QRectF(self.rect()).adjusted(self.MARGIN_LEFT, self.MARGIN_TOP, -right, -self.MARGIN_BOTTOM)

    def _to_pixel(self, area: QRectF, x: float, y: float) -> QPointF:
        (x0, x1), (y0, y1) = self._ranges
        return QPointF(
            area.left() + (x - x0) / (x1 - x0) * area.width(),
            area.bottom() - (y - y0) / (y1 - y0) * area.height(),
        )

    def paintEvent(self, event) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        painter.fillRect(self.rect(), self.palette().color(QPalette.ColorRole.Base))
        area = self._plot_rect()
        self._draw_axes(painter, area)
        if not self._measured:
            painter.drawText(area, Qt.AlignmentFlag.AlignCenter, "No measurements yet")
            return
        painter.setClipRect(area.adjusted(-4, -4, 4, 4))
        for draft_len, points in self._predicted.items():
            self._draw_series(painter, area, draft_len, points, dashed=True)
        for draft_len, points in self._measured.items():
            self._draw_series(painter, area, draft_len, points, dashed=False)
        painter.setClipping(False)
        self._draw_legend(painter, area)

    def _draw_axes(self, painter: QPainter, area: QRectF) -> None:
        text = self.palette().color(QPalette.ColorRole.Text)
        grid = QColor(text)
        grid.setAlpha(40)
        (x0, x1), (y0, y1) = self._ranges
        metrics = painter.fontMetrics()
        for tick in nice_ticks(y0, y1):
            y = self._to_pixel(area, x0, tick).y()
            painter.setPen(QPen(grid, 1))
            painter.drawLine(QPointF(area.left(), y), QPointF(area.right(), y))
            painter.setPen(text)
            label = f"{tick:g}"
            painter.drawText(
                QPointF(area.left() - metrics.horizontalAdvance(label) - 6, y + metrics.ascent() / 2 - 1),
                label,
            )
        for layer in range(math.ceil(x0), math.floor(x1) + 1):
            x = self._to_pixel(area, layer, y0).x()
            label = "none" if layer == -1 else str(layer)
            painter.setPen(text)
            painter.drawLine(QPointF(x, area.bottom()), QPointF(x, area.bottom() + 4))
            painter.drawText(
                QPointF(x - metrics.horizontalAdvance(label) / 2, area.bottom() + 6 + metrics.ascent()), label
            )
        painter.setPen(QPen(text, 1))
        painter.drawRect(area)
        x_title = "Prefetch cutoff layer (none: no prefetch)"
        painter.drawText(
            QPointF(
                area.center().x() - metrics.horizontalAdvance(x_title) / 2,
                self.height() - metrics.descent() - 4,
            ),
            x_title,
        )
        painter.save()
        painter.translate(metrics.height(), area.center().y())
        painter.rotate(-90)
        y_title = "Time per token (ms)"
        painter.drawText(QPointF(-metrics.horizontalAdvance(y_title) / 2, 0), y_title)
        painter.restore()

    def _draw_series(
        self, painter: QPainter, area: QRectF, draft_len: int, points: list[tuple[int, float]], dashed: bool
    ) -> None:
        pen = QPen(self.series_color(draft_len), 1.5 if dashed else 2.2)
        pen.setStyle(Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine)
        painter.setPen(pen)
        if draft_len == 0 and len(points) == 1:  # plain decoding: one figure, drawn across as a reference
            y = self._to_pixel(area, 0, points[0][1]).y()
            painter.drawLine(QPointF(area.left(), y), QPointF(area.right(), y))
        path = QPainterPath()
        pixels = [self._to_pixel(area, x, y) for x, y in points]
        path.moveTo(pixels[0])
        for pixel in pixels[1:]:
            path.lineTo(pixel)
        painter.drawPath(path)
        if not dashed:
            painter.setBrush(self.series_color(draft_len))
            for pixel in pixels:
                painter.drawEllipse(pixel, 3.5, 3.5)
            painter.setBrush(Qt.BrushStyle.NoBrush)

    def legend_entries(self) -> list[tuple[str, int, bool]]:
        """(label, draft length, dashed) for each line the legend lists."""
        entries = []
        for draft_len in self._measured:
            name = "plain decoding" if draft_len == 0 else f"draft {draft_len}"
            entries.append((f"{name}, measured", draft_len, False))
            if draft_len in self._predicted:
                entries.append((f"{name}, predicted", draft_len, True))
        return entries

    def _draw_legend(self, painter: QPainter, area: QRectF) -> None:
        metrics = painter.fontMetrics()
        x, y = area.right() + 12, area.top() + metrics.height()
        for label, draft_len, dashed in self.legend_entries():
            pen = QPen(self.series_color(draft_len), 1.5 if dashed else 2.2)
            pen.setStyle(Qt.PenStyle.DashLine if dashed else Qt.PenStyle.SolidLine)
            painter.setPen(pen)
            mid = y - metrics.ascent() / 2 + 1
            painter.drawLine(QPointF(x, mid), QPointF(x + 22, mid))
            painter.setPen(self.palette().color(QPalette.ColorRole.Text))
            painter.drawText(QPointF(x + 28, y), label)
            y += metrics.height() + 3
