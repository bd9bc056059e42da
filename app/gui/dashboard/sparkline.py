"""A small live line plot of the last minute of one series, drawn with QPainter.

`Sparkline.add(t, value)` appends a sample (`t` in seconds on any monotonic
clock, `value` None for "not known then", which leaves a gap in the line).
The x axis ends at the newest sample, so the plot scrolls with the data, not
with the wall clock. The y axis starts at 0 (a faint baseline) and is scaled
to the largest value in the window, or to a fixed maximum (1.0 for rates).

Adding samples never repaints at once: repaints are coalesced by a single-shot
timer to at most `MAX_REPAINT_HZ`, and the widget's size never depends on its
data, so a stream of samples causes no re-layout. The pure helpers
(`trim_window`, `y_scale`, `to_pixels`) hold all the arithmetic and are tested
without painting.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence

from PySide6.QtCore import QPointF, QSize, Qt, QTimer
from PySide6.QtGui import QColor, QPainter, QPaintEvent, QPen
from PySide6.QtWidgets import QSizePolicy, QWidget

WINDOW_S = 60.0
MAX_REPAINT_HZ = 4
DOT_RADIUS = 2.5
HEADROOM = 1.1  # auto-scaled plots leave 10 % above the largest value

Sample = tuple[float, float | None]


def trim_window(samples: Iterable[Sample], now: float, window_s: float = WINDOW_S) -> list[Sample]:
    """The samples no older than `window_s` before `now`, in order."""
    start = now - window_s
    return [(t, v) for t, v in samples if t >= start]


def y_scale(values: Iterable[float | None], fixed_max: float | None = None) -> float:
    """The value drawn at the top edge: `fixed_max`, or the window's largest value plus headroom.

    Never zero or negative, so an all-zero (or empty) series draws on its baseline."""
    if fixed_max is not None and fixed_max > 0:
        return fixed_max
    finite = [v for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    return top * HEADROOM if top > 0 else 1.0


def to_pixels(
    samples: Sequence[Sample],
    now: float,
    y_max: float,
    width: float,
    height: float,
    window_s: float = WINDOW_S,
    margin: float = DOT_RADIUS + 1,
) -> list[list[tuple[float, float]]]:
    """The samples as line segments of (x, y) pixels; a None (or non-finite) value starts a new segment.

    x runs from `now - window_s` (left) to `now` (right); y from 0 (bottom) to `y_max` (top),
    clamped to the plot so an outlier above a fixed maximum stays visible at the top edge."""
    plot_w, plot_h = max(width - 2 * margin, 1.0), max(height - 2 * margin, 1.0)
    segments: list[list[tuple[float, float]]] = []
    current: list[tuple[float, float]] = []
    for t, value in samples:
        if value is None or not math.isfinite(value):
            if current:
                segments.append(current)
            current = []
            continue
        x = margin + plot_w * (1.0 - (now - t) / window_s)
        fraction = min(max(value / y_max, 0.0), 1.0)
        current.append((x, margin + plot_h * (1.0 - fraction)))
    if current:
        segments.append(current)
    return segments


class Sparkline(QWidget):
    """The last `window_s` seconds of one series as a line, its newest value as a dot."""

    def __init__(
        self,
        parent: QWidget | None = None,
        fixed_max: float | None = None,
        color: QColor | str | None = None,
        window_s: float = WINDOW_S,
    ):
        super().__init__(parent)
        self.fixed_max = fixed_max
        self.window_s = window_s
        self._color = QColor(color) if color is not None else None
        self._samples: deque[Sample] = deque()
        self._muted = False  # greyed: the samples are not live (the last reply's)
        self._repaint = QTimer(self)
        self._repaint.setSingleShot(True)
        self._repaint.setInterval(1000 // MAX_REPAINT_HZ)
        self._repaint.timeout.connect(self.update)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setFixedHeight(30)

    def sizeHint(self) -> QSize:
        return QSize(120, 30)

    def minimumSizeHint(self) -> QSize:
        return QSize(40, 30)

    def add(self, t: float, value: float | None) -> None:
        """Append a sample (None: unknown at `t`, drawn as a gap); repaints within 1/MAX_REPAINT_HZ s."""
        if self._samples and t < self._samples[-1][0]:  # a restarted worker's clock: start afresh
            self._samples.clear()
        self._samples.append((t, value))
        start = t - self.window_s
        while self._samples and self._samples[0][0] < start:
            self._samples.popleft()
        if not self._repaint.isActive():
            self._repaint.start()

    def clear(self) -> None:
        """Forget every sample (e.g. when another model is loaded)."""
        self._samples.clear()
        self.update()

    def set_muted(self, muted: bool) -> None:
        """Draw the line grey: its samples are not live (the last reply's, a stopped engine's)."""
        if muted != self._muted:
            self._muted = muted
            self.update()

    def samples(self) -> list[Sample]:
        """The samples in the window, oldest first."""
        return list(self._samples)

    def paintEvent(self, event: QPaintEvent) -> None:
        painter = QPainter(self)
        painter.setRenderHint(QPainter.RenderHint.Antialiasing)
        color = self._color or self.palette().highlight().color()
        if self._muted:
            color = self.palette().placeholderText().color()
        baseline = self.palette().windowText().color()
        baseline.setAlpha(50)
        bottom = self.height() - DOT_RADIUS - 1
        painter.setPen(QPen(baseline, 1))
        painter.drawLine(QPointF(0, bottom), QPointF(self.width(), bottom))
        if not self._samples:
            painter.end()
            return
        now = self._samples[-1][0]
        y_max = y_scale((v for _, v in self._samples), self.fixed_max)
        segments = to_pixels(list(self._samples), now, y_max, self.width(), self.height(), self.window_s)
        painter.setPen(QPen(color, 1.5))
        for segment in segments:
            if len(segment) > 1:
                painter.drawPolyline([QPointF(x, y) for x, y in segment])
        latest = self._samples[-1][1]
        if latest is not None and math.isfinite(latest) and segments:
            x, y = segments[-1][-1]
            painter.setPen(Qt.PenStyle.NoPen)
            painter.setBrush(color)
            painter.drawEllipse(QPointF(x, y), DOT_RADIUS, DOT_RADIUS)
        painter.end()
