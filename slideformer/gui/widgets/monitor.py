"""The Monitor panel: small live charts of GPU and host figures.

Samples arrive by signal (:meth:`MonitorPanel.add_sample`) into a :class:`History` of ring
buffers; a timer repaints the charts from the buffers at :data:`REPAINT_HZ` when something new
arrived and the panel is visible. Plot items are created once and only ever get ``setData``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, QTimer, Slot
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from slideformer.gui.models.monitor import GIB, History, Sample
from slideformer.gui.widgets.chart import chart_head, line_plot
from slideformer.gui.widgets.common import color_plot

REPAINT_HZ = 15
WINDOW_S = 120.0
"""Seconds of history on screen."""
CAPACITY = 1200
"""Samples kept: five minutes at 4 Hz."""


@dataclass(frozen=True)
class Curve:
    series: str
    """A column of :data:`~slideformer.gui.models.monitor.SERIES`."""
    label: str
    """Shown before the value when a chart has several curves."""
    color: str


@dataclass(frozen=True)
class Chart:
    """What one chart shows and how its figures are written."""

    title: str
    curves: tuple[Curve, ...]
    unit: str
    scale: float
    """Raw values are divided by this before plotting (bytes -> GiB)."""
    decimals: int
    total: str | None = None
    """Series holding the ceiling of the first curve (memory): shown as "used / total"."""
    y_max: float | None = None
    """Fixed top of the y axis; None: from the data (or ``total``)."""
    gpu: bool = True
    """Hidden when there is no GPU to read."""


BLUE, ORANGE, GREEN, RED, PURPLE, TEAL = (
    "#3b82f6", "#f59e0b", "#22c55e", "#ef4444", "#a855f7", "#14b8a6")

CHARTS = (
    Chart("GPU memory", (Curve("mem_used", "used", BLUE),), "GiB", GIB, 1, total="mem_total"),
    Chart("GPU utilisation", (Curve("util", "", GREEN),), "%", 1.0, 0, y_max=100.0),
    Chart("PCIe", (Curve("pcie_rx", "to GPU", BLUE), Curve("pcie_tx", "from GPU", ORANGE)),
          "GB/s", 1e9, 1),
    Chart("GPU temperature", (Curve("temperature", "", RED),), "°C", 1.0, 0, y_max=100.0),
    Chart("GPU power", (Curve("power", "", PURPLE),), "W", 1.0, 0),
    Chart("Host RAM", (Curve("ram_used", "used", TEAL),), "GiB", GIB, 1, total="ram_total",
          gpu=False),
    Chart("CPU", (Curve("cpu", "", GREEN),), "%", 1.0, 0, y_max=100.0, gpu=False),
)


def value_text(chart: Chart, history: History) -> str:
    """The newest figures of ``chart`` as rich text, e.g. "14.2 / 24.0 GiB"; "n/a" if missing."""
    def fmt(series: str) -> str:
        v = history.latest(series)
        return "n/a" if v is None else f"{v / chart.scale:.{chart.decimals}f}"

    first = chart.curves[0].series
    if chart.total is not None:
        return f"{fmt(first)} / {fmt(chart.total)} {chart.unit}"
    if len(chart.curves) == 1:
        return f"{fmt(first)} {chart.unit}"
    parts = [f'<span style="color:{c.color}">{c.label} {fmt(c.series)}</span>'
             for c in chart.curves]
    return " · ".join(parts) + f" {chart.unit}"


class ChartView(QWidget):
    """A title, the newest value, and a plot whose curves are created once."""

    def __init__(self, chart: Chart, parent=None):
        super().__init__(parent)
        self.chart = chart
        self.title, self.value, head = chart_head(f"{chart.title} ({chart.unit})", "n/a")
        self.plot = line_plot(60, 36, 18)  # the unit is in the title, not beside the axis
        self.plot.setMouseEnabled(x=False, y=False)
        item = self.plot.getPlotItem()
        item.setXRange(-WINDOW_S, 0, padding=0)
        if chart.y_max is not None:  # fixed scale: three ticks read better than five at this size
            top = chart.y_max
            item.getAxis("left").setTicks([[(v, f"{v:.0f}") for v in (0, top / 2, top)]])
        self.curves = [self.plot.plot(pen=pg.mkPen(c.color, width=1.6), connect="finite",
                                      antialias=True)
                       for c in chart.curves]

        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 2, 0, 2)
        lay.setSpacing(0)
        lay.addLayout(head)
        lay.addWidget(self.plot)

    def set_colors(self, background: str, foreground: str) -> None:
        color_plot(self.plot, background, foreground)

    def repaint_from(self, history: History, x: np.ndarray) -> None:
        c = self.chart
        top = 0.0
        for curve, spec in zip(self.curves, c.curves):
            y = history.series(spec.series) / c.scale
            curve.setData(x, y)
            if np.isfinite(y).any():
                top = max(top, float(np.nanmax(y)))
        if c.y_max is not None:
            top = c.y_max
        elif c.total is not None and history.latest(c.total) is not None:
            top = history.latest(c.total) / c.scale
        else:
            top = max(top * 1.2, 1.0)
        self.plot.getPlotItem().setYRange(0, top, padding=0.02)
        self.value.setText(value_text(c, history))


class MonitorPanel(QWidget):
    """Live charts fed by :meth:`add_sample`; hides the GPU charts after :meth:`show_no_gpu`."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setObjectName("monitorPanel")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground)  # let the style sheet paint it
        self.history = History(CAPACITY)
        self.device = QLabel("Looking for a GPU…")
        self.device.setObjectName("monitorDevice")
        self.notice = QLabel()
        self.notice.setObjectName("notice")
        self.notice.hide()
        # No word wrap on these labels: it would give the panel a height-for-width layout, and
        # the dock's scroll area would then size it to the charts' (tall) size hints.
        self.charts = [ChartView(c) for c in CHARTS]

        lay = QVBoxLayout(self)
        lay.setContentsMargins(8, 6, 8, 6)
        lay.setSpacing(2)
        lay.addWidget(self.device)
        lay.addWidget(self.notice)
        for view in self.charts:
            view.setMaximumHeight(170)
            lay.addWidget(view, 1)
        lay.addStretch(0)  # takes what the capped charts leave (host-only: two charts)
        for view in self.charts[:-1]:
            view.plot.getPlotItem().getAxis("bottom").setStyle(showValues=False)
        last = self.charts[-1].plot.getPlotItem()
        last.setLabel("bottom", "seconds ago")
        last.getAxis("bottom").setHeight(34)

        self.repaints = 0
        """Repaints done (tests check that the timer drives the charts)."""
        self._dirty = False
        self._timer = QTimer(self)
        self._timer.setInterval(1000 // REPAINT_HZ)
        self._timer.timeout.connect(self._repaint)
        self._timer.start()

    @Slot(object)
    def add_sample(self, sample: Sample) -> None:
        self.history.append(sample)
        self._dirty = True

    @Slot(str)
    def show_gpu(self, name: str) -> None:
        self.device.setText(name)
        self.device.show()
        self.notice.hide()
        for view in self.charts:
            view.setVisible(True)

    @Slot(str, str)
    def show_no_gpu(self, notice: str, reason: str) -> None:
        self.device.hide()
        self.notice.setText(notice)
        self.notice.setToolTip(reason)
        self.notice.show()
        for view in self.charts:
            view.setVisible(not view.chart.gpu)

    def set_colors(self, background: str, foreground: str) -> None:
        for view in self.charts:
            view.set_colors(background, foreground)

    def _repaint(self) -> None:
        if not self._dirty or not self.isVisible() or not len(self.history):
            return
        self._dirty = False
        t = self.history.times()
        x = t - t[-1]
        for view in self.charts:
            if view.isVisible():
                view.repaint_from(self.history, x)
        self.repaints += 1
