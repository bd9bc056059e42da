"""The tuning result plot: measured vs predicted TPOT against the prefetch cutoff layer.

`TuneCurvePlot` is a QWidget drawn with QPainter (no QtCharts). Each drafter has its own
colour family and marker: the draft model blue circles, self-speculation orange squares,
substitutes green, MTP purple,
plain decoding a grey line across (its spread a grey band); each draft length a shade of
its drafter's colour. A measured point is its median with its spread (low–high) as an
error bar, nudged sideways per series so bars at one cutoff do not hide each other; the
chosen point is ringed; the prediction is dashed in the colour of the series it predicts.
`set_data(measured, predicted, chosen)` takes the curve points as plain dicts (cutoff_layer,
draft_len, tpot_ms, and when measured drafter, tpot_low_ms, tpot_high_ms). The pure helpers
`series_by_drafter`, `series_by_draft_len`, `nice_ticks` and `axis_ranges` group the points and
lay out the axes.
"""

from __future__ import annotations

import math
from typing import Any

from PySide6.QtCore import QPointF, QRectF, Qt
from PySide6.QtGui import QColor, QPainter, QPainterPath, QPalette, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

PLAIN_COLOR = "#666666"
DRAFTER_SHADES = {  # darkest first: the shortest draft length measured gets the first
    "draft": ("#08519c", "#3182bd", "#6baed6", "#9ecae1"),
    "self": ("#a63603", "#e6550d", "#fd8d3c", "#fdae6b"),
    "substitute": ("#006d2c", "#31a354", "#74c476", "#a1d99b"),
    "mtp": ("#54278f", "#756bb1", "#9e9ac8", "#bcbddc"),
}
DRAFTER_NAMES = {
    "draft": "draft model",
    "self": "self",
    "substitute": "substitutes",
    "mtp": "MTP",
    "": "speculation",
}
Series = tuple[str, int]  # (drafter, draft length); ("", 0) is plain decoding
Bar = tuple[int, float, float, float]  # (cutoff layer, median, low, high) in ms


def series_by_drafter(points: list[dict[str, Any]]) -> dict[Series, list[Bar]]:
    """Measured points grouped by (drafter, draft length), plain decoding first, then the draft
    model's and self's by draft length; each as (cutoff, median, low, high) sorted by cutoff. A
    point without a spread (one run) has low = high = median."""
    groups: dict[Series, list[Bar]] = {}
    for point in points:
        draft_len = int(point["draft_len"])
        key = (str(point.get("drafter") or "") if draft_len else "", draft_len)
        tpot = float(point["tpot_ms"])
        low, high = point.get("tpot_low_ms"), point.get("tpot_high_ms")
        bar = (int(point["cutoff_layer"]), tpot, tpot if low is None else low, tpot if high is None else high)
        groups.setdefault(key, []).append(bar)
    order = {"": 0, "draft": 1, "self": 2, "substitute": 3, "mtp": 4}
    return {
        key: sorted(groups[key]) for key in sorted(groups, key=lambda k: (order.get(k[0], 3), k[0], k[1]))
    }


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
    TPOT values and the measured spreads, rounded out to ticks. Empty data gives (-1, 1) × (0, 1)."""
    points = measured + predicted
    if not points:
        return (-1.5, 1.5), (0.0, 1.0)
    cutoffs = [int(p["cutoff_layer"]) for p in points]
    tpots = [float(p.get(field) or p["tpot_ms"]) for p in points for field in ("tpot_low_ms", "tpot_high_ms")]
    ticks = nice_ticks(min(tpots), max(tpots))
    return (min(cutoffs) - 0.5, max(cutoffs) + 0.5), (ticks[0], ticks[-1])


class TuneCurvePlot(QWidget):
    """Measured TPOT per drafter and draft length (median, error bars) and the prediction (dashed)
    against the prefetch cutoff layer; the chosen point ringed."""

    MARGIN_LEFT, MARGIN_RIGHT, MARGIN_TOP, MARGIN_BOTTOM = 62, 120, 14, 46
    DODGE = 0.07  # layers between neighbouring series' bars at one cutoff

    def __init__(self, parent: QWidget | None = None):
        super().__init__(parent)
        self.setMinimumSize(460, 240)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self._measured: dict[Series, list[Bar]] = {}
        self._predicted: dict[Series, list[tuple[int, float]]] = {}
        self._chosen: tuple[Series, int] | None = None
        self._ranges = axis_ranges([], [])

    def set_data(
        self,
        measured: list[dict[str, Any]],
        predicted: list[dict[str, Any]],
        chosen: dict[str, Any] | None = None,
    ) -> None:
        """Plot these curve points (the measured ones run with the default prefetch and cache
        policies: the others are the summary's); each drafter's prediction for the draft lengths
        measured, drawn with it (a prediction that names no drafter, from an older result, with the
        draft model where one was measured, else self); `chosen` (the TuneChoice dict) is ringed."""
        measured = [p for p in measured if not any(p.get(k) for k in ("prefetch", "policy", "cpu_experts"))]
        self._measured = series_by_drafter(measured)
        drafters = {drafter for drafter, draft_len in self._measured if draft_len}
        unnamed = "draft" if "draft" in drafters else min(drafters, default="")
        self._predicted = {}
        for drafter in {str(p.get("drafter") or "") for p in predicted}:
            own = [p for p in predicted if str(p.get("drafter") or "") == drafter]
            for draft_len, points in series_by_draft_len(own).items():
                key = ("", 0) if draft_len == 0 else (drafter or unnamed, draft_len)
                if key in self._measured:
                    self._predicted[key] = points
        kept = [p for p in predicted if self._kept(p, unnamed)]
        self._ranges = axis_ranges(measured, kept)
        self._chosen = None
        if chosen is not None:
            draft_len = int(chosen.get("draft_len", 0))
            key = (str(chosen.get("drafter") or "") if draft_len else "", draft_len)
            self._chosen = (key, int(chosen.get("cutoff_layer", -1)))
        self.update()

    def _kept(self, point: dict[str, Any], unnamed: str) -> bool:
        draft_len = int(point["draft_len"])
        key = ("", 0) if draft_len == 0 else (str(point.get("drafter") or "") or unnamed, draft_len)
        return key in self._predicted

    def series_color(self, key: Series) -> QColor:
        """The colour of one series: a shade of its drafter's colour by draft length; plain is grey."""
        drafter, draft_len = key
        if draft_len == 0:
            return QColor(PLAIN_COLOR)
        shades = DRAFTER_SHADES.get(drafter, DRAFTER_SHADES["draft"])
        lens = sorted(d for k, d in self._measured if k == drafter and d > 0)
        index = lens.index(draft_len) if draft_len in lens else 0
        return QColor(shades[min(index, len(shades) - 1)])

    def legend_entries(self) -> list[tuple[str, Series | None, str]]:
        """(label, series, how it is drawn: "measured", "predicted" or "chosen") for each legend line;
        one dashed entry stands for every predicted series (each dashed in its series' colour)."""
        entries: list[tuple[str, Series | None, str]] = []
        for key in self._measured:
            drafter, draft_len = key
            label = (
                "plain decoding"
                if draft_len == 0
                else f"{DRAFTER_NAMES.get(drafter, drafter)}, {draft_len} tokens"
            )
            entries.append((label, key, "measured"))
        if self._predicted:
            entries.append(("predicted (dashed)", None, "predicted"))
        if self._chosen is not None and self._chosen[0] in self._measured:
            entries.append(("chosen", None, "chosen"))
        return entries

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

    def _dodge(self, key: Series) -> float:
        """The sideways offset of a series' bars (in layers), centred around the cutoff."""
        keys = [k for k in self._measured if k[1] > 0]
        if key not in keys:
            return 0.0
        return (keys.index(key) - (len(keys) - 1) / 2) * self.DODGE

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
        plain = self._measured.get(("", 0))
        if plain and len(plain) == 1:
            self._draw_plain_reference(painter, area, plain[0])
        for key, points in self._predicted.items():
            self._draw_prediction(painter, area, key, points)
        for key, bars in self._measured.items():
            self._draw_measured(painter, area, key, bars)
        self._draw_chosen(painter, area)
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

    def _draw_plain_reference(self, painter: QPainter, area: QRectF, bar: Bar) -> None:
        """Plain decoding is one figure whatever the cutoff: its median across, its spread a band."""
        _, median, low, high = bar
        band = QColor(PLAIN_COLOR)
        band.setAlpha(40)
        top, bottom = self._to_pixel(area, 0, high).y(), self._to_pixel(area, 0, low).y()
        painter.fillRect(QRectF(area.left(), top, area.width(), max(bottom - top, 1.0)), band)
        painter.setPen(QPen(QColor(PLAIN_COLOR), 1.5))
        y = self._to_pixel(area, 0, median).y()
        painter.drawLine(QPointF(area.left(), y), QPointF(area.right(), y))

    def _draw_prediction(
        self, painter: QPainter, area: QRectF, key: Series, points: list[tuple[int, float]]
    ) -> None:
        pen = QPen(self.series_color(key), 1.4)
        pen.setStyle(Qt.PenStyle.DashLine)
        painter.setPen(pen)
        if key == ("", 0) and len(points) == 1:  # plain decoding: one figure, drawn across
            y = self._to_pixel(area, 0, points[0][1]).y()
            painter.drawLine(QPointF(area.left(), y), QPointF(area.right(), y))
            return
        path = QPainterPath()
        pixels = [self._to_pixel(area, x, y) for x, y in points]
        path.moveTo(pixels[0])
        for pixel in pixels[1:]:
            path.lineTo(pixel)
        painter.drawPath(path)

    def _draw_measured(self, painter: QPainter, area: QRectF, key: Series, bars: list[Bar]) -> None:
        """The medians joined by a line, each with its error bar (low–high, capped) and marker."""
        color = self.series_color(key)
        dodge = self._dodge(key)
        medians = [self._to_pixel(area, cutoff + dodge, median) for cutoff, median, _, _ in bars]
        painter.setPen(QPen(color, 2.0))
        path = QPainterPath()
        path.moveTo(medians[0])
        for pixel in medians[1:]:
            path.lineTo(pixel)
        painter.drawPath(path)
        painter.setPen(QPen(color, 1.3))
        for cutoff, _, low, high in bars:
            top, bottom = (
                self._to_pixel(area, cutoff + dodge, high),
                self._to_pixel(area, cutoff + dodge, low),
            )
            painter.drawLine(top, bottom)
            for end in (top, bottom):
                painter.drawLine(QPointF(end.x() - 3, end.y()), QPointF(end.x() + 3, end.y()))
        for pixel in medians:
            self._draw_marker(painter, pixel, key)

    def _draw_marker(self, painter: QPainter, center: QPointF, key: Series) -> None:
        """A circle for the draft model and plain decoding, a square for self-speculation."""
        painter.setPen(QPen(self.palette().color(QPalette.ColorRole.Base), 1))
        painter.setBrush(self.series_color(key))
        if key[0] == "self":
            painter.drawRect(QRectF(center.x() - 3.5, center.y() - 3.5, 7, 7))
        else:
            painter.drawEllipse(center, 4, 4)
        painter.setBrush(Qt.BrushStyle.NoBrush)

    def _draw_chosen(self, painter: QPainter, area: QRectF) -> None:
        if self._chosen is None:
            return
        key, cutoff = self._chosen
        median = next((m for c, m, _, _ in self._measured.get(key, []) if c == cutoff), None)
        if median is None:
            return
        painter.setPen(QPen(self.palette().color(QPalette.ColorRole.Text), 1.6))
        painter.drawEllipse(self._to_pixel(area, cutoff + self._dodge(key), median), 8, 8)

    def _draw_legend(self, painter: QPainter, area: QRectF) -> None:
        metrics = painter.fontMetrics()
        text = self.palette().color(QPalette.ColorRole.Text)
        x, y = area.right() + 12, area.top() + metrics.height()
        for label, key, kind in self.legend_entries():
            mid = QPointF(x + 11, y - metrics.ascent() / 2 + 1)
            if kind == "chosen":
                painter.setPen(QPen(text, 1.6))
                painter.drawEllipse(mid, 7, 7)
            else:
                pen = QPen(self.series_color(key) if key else text, 1.4 if key is None else 2.0)
                pen.setStyle(Qt.PenStyle.DashLine if kind == "predicted" else Qt.PenStyle.SolidLine)
                painter.setPen(pen)
                painter.drawLine(QPointF(x, mid.y()), QPointF(x + 22, mid.y()))
                if key is not None:
                    self._draw_marker(painter, mid, key)
            painter.setPen(text)
            painter.drawText(QPointF(x + 28, y), label)
            y += metrics.height() + 3
