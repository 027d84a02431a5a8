"""The Train page's charts: metric plots over steps, and the pipeline timeline of one step.

Plot items are created once; :meth:`MetricPlot.repaint_from` and :meth:`TimelineView.show`
only call ``setData`` / ``setOpts`` (the page calls them from its repaint timer).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QLabel, QVBoxLayout, QWidget

from slideformer.engine.api import Timeline
from slideformer.gui.models.metrics import StepHistory, format_seconds
from slideformer.gui.widgets.chart import chart_head, line_plot, small_axes
from slideformer.gui.widgets.common import color_plot, fixed_width

BLUE, ORANGE, GREEN, RED, PURPLE, TEAL, GREY = (
    "#3b82f6", "#f59e0b", "#22c55e", "#ef4444", "#a855f7", "#14b8a6", "#9ca3af")
GIB = float(1 << 30)
MIN_LABEL_PX = 22
"""A compute bar is named (L0, head...) only when it is at least this wide on screen."""
LANE_AXIS_PX = 170
"""Room for the lane names and busy times; a name wider than its axis is not drawn at all."""


@dataclass(frozen=True)
class Line:
    column: str
    """A :data:`~slideformer.gui.models.metrics.COLUMNS` name, or "val" (validation loss)."""
    label: str
    color: str
    width: float = 2.0
    alpha: int = 255
    scale: float = 1.0
    """Values are divided by this (bytes -> GiB)."""


@dataclass(frozen=True)
class Metric:
    title: str
    lines: tuple[Line, ...]
    fmt: str
    """Format of the newest value of each line, e.g. "{:.3f}"."""
    axis: str
    """What the y axis counts, with its unit."""
    unit: str = ""
    """Unit written after the newest values."""
    log_y: bool = False


METRICS = {
    "loss": Metric("Loss", (Line("loss", "raw", BLUE, 1.0, 90), Line("smooth", "smoothed", BLUE),
                            Line("val", "validation", ORANGE)), "{:.3f}", "nats/token"),
    "lr": Metric("Learning rate", (Line("lr", "", PURPLE),), "{:.2e}", "lr"),  # short: scaled
    "grad_norm": Metric("Gradient norm", (Line("grad_norm", "", RED),), "{:.2f}", "L2 norm"),
    "tokens_per_s": Metric("Throughput", (Line("tokens_per_s", "", GREEN),), "{:,.0f}",
                           "tokens/s", "tok/s"),
    # chosen and rejected named by their colours only: three named values overflow the head
    "rewards": Metric("Rewards", (Line("chosen_reward", "", GREEN),
                                  Line("rejected_reward", "", RED),
                                  Line("margin", "margin", BLUE)), "{:.2f}", "implicit reward"),
    "reward": Metric("Reward", (Line("reward_mean", "mean", GREEN),), "{:.3f}", "reward"),
    "memory": Metric("Peak memory", (Line("peak_vram", "VRAM", BLUE, scale=GIB),
                                     Line("peak_ram", "RAM", TEAL, scale=GIB)), "{:.2f}", "GiB",
                     "GiB"),
}


class MetricPlot(QWidget):
    """A title, the newest values, and one plot over optimizer steps."""

    def __init__(self, metric: Metric, parent=None):
        super().__init__(parent)
        self.spec = metric  # not "metric": that name would shadow QWidget.metric()
        self.title, self.value, head = chart_head(metric.title, "—")
        fixed_width(self.value)
        self.plot = line_plot(90, 58, 32)  # tick values and the axis name beside / below them
        item = self.plot.getPlotItem()
        item.setLogMode(y=metric.log_y)
        item.setLabel("left", metric.axis)
        item.setLabel("bottom", "step")
        self.curves = []
        for line in metric.lines:
            color = pg.mkColor(line.color)
            color.setAlpha(line.alpha)
            symbol = {"symbol": "o", "symbolSize": 5, "symbolBrush": line.color,
                      "symbolPen": None} if line.column == "val" else {}
            self.curves.append(self.plot.plot(pen=pg.mkPen(color, width=line.width),
                                              connect="finite", **symbol))
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 2, 0, 2)
        lay.setSpacing(0)
        # An empty chart says what it waits for, instead of showing made-up 0-1 axes.
        self.waiting = QLabel("waiting for the first step")
        self.waiting.setObjectName("hint")
        self.waiting.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.waiting.setMinimumHeight(90)
        lay.addLayout(head)
        lay.addWidget(self.plot, 1)
        lay.addWidget(self.waiting, 1)
        self.plot.hide()

    def set_colors(self, background: str, foreground: str) -> None:
        color_plot(self.plot, background, foreground)

    def repaint_from(self, history: StepHistory) -> None:
        steps = history.column("step")
        self.plot.setVisible(len(steps) > 0)
        self.waiting.setVisible(len(steps) == 0)
        texts = []
        for curve, line in zip(self.curves, self.spec.lines):
            if line.column == "val":
                x, y = np.array(history.val_steps, float), np.array(history.val_losses, float)
            else:
                x, y = steps, history.column(line.column) / line.scale
            curve.setData(x, y)
            finite = y[np.isfinite(y)]
            if len(finite):  # a line with no value yet (validation, VRAM on the CPU) is left out
                label = f"{line.label} " if len(self.spec.lines) > 1 and line.label else ""
                texts.append(f'<span style="color:{line.color}">{label}'
                             f'{self.spec.fmt.format(finite[-1])}</span>')
        unit = f" {self.spec.unit}" if self.spec.unit and texts else ""
        self.value.setText(" · ".join(texts) + unit if texts else "—")

    def clear(self) -> None:
        for curve in self.curves:
            curve.setData([], [])
        self.value.setText("—")
        self.plot.hide()
        self.waiting.show()


# Lanes of the timeline, top to bottom: (lane name in the Timeline event, label, colour).
LANES = (("compute", "compute", BLUE), ("h2d", "upload to GPU", GREEN),
         ("d2h", "download to CPU", ORANGE), ("optimizer", "CPU optimizer", PURPLE),
         ("disk", "disk", GREY))


class TimelineView(QWidget):
    """One step's work per resource as horizontal bars, one bar per item (layer, head...)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.caption = QLabel("The timeline of the latest step appears here once the run has "
                              "made two steps.")
        self.caption.setObjectName("chartTitle")
        fixed_width(self.caption)
        self.plot = pg.PlotWidget()
        self.plot.hideButtons()
        self.plot.setMenuEnabled(False)
        self.plot.setMouseEnabled(x=True, y=False)
        item = self.plot.getPlotItem()
        item.showGrid(x=True, alpha=0.15)
        item.setLabel("bottom", "milliseconds from the start of the step")
        small_axes(item, LANE_AXIS_PX, 32)
        item.invertY(True)
        self.bars = pg.BarGraphItem(x0=[], x1=[], y0=[], y1=[], pen=None)
        self.plot.addItem(self.bars)
        self.labels: list[pg.TextItem] = []
        self.step: int | None = None
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(2)
        lay.addWidget(self.caption)
        lay.addWidget(self.plot, 1)
        self.plot.hide()  # no made-up axes before there is a step to draw

    def set_colors(self, background: str, foreground: str) -> None:
        color_plot(self.plot, background, foreground)

    def show_timeline(self, timeline: Timeline, step_time: float | None = None) -> None:
        """Draw ``timeline`` (spans in seconds from the step start)."""
        self.step = timeline.step
        self.plot.show()
        lanes = [lane for lane in LANES if any(s.lane == lane[0] for s in timeline.spans)]
        row = {name: i for i, (name, _, _) in enumerate(lanes)}
        colour = {name: c for name, _, c in LANES}
        x0, x1, y0, y1, brushes = [], [], [], [], []
        busy = dict.fromkeys(row, 0.0)
        counts = dict.fromkeys(row, 0)
        for s in timeline.spans:
            if s.lane not in row:
                continue
            r = row[s.lane]
            x0.append(s.start * 1e3)
            x1.append(max(s.end, s.start) * 1e3)
            y0.append(r - 0.36)
            y1.append(r + 0.36)
            c = pg.mkColor(colour[s.lane])
            brushes.append(pg.mkBrush(c if counts[s.lane] % 2 == 0 else c.lighter(135)))
            counts[s.lane] += 1
            busy[s.lane] += s.end - s.start
        self.bars.setOpts(x0=x0, x1=x1, y0=y0, y1=y1, brushes=brushes)
        ticks = [(i, f"{label}  {format_seconds(busy[name])}")
                 for i, (name, label, _) in enumerate(lanes)]
        item = self.plot.getPlotItem()
        item.getAxis("left").setTicks([ticks])
        end = max(x1, default=1.0)
        item.setXRange(0, end * 1.02, padding=0)
        item.setYRange(-0.6, len(lanes) - 0.4, padding=0)
        self._label_items(timeline, row, end * 1.02)
        total = step_time if step_time is not None else end / 1e3
        self.caption.setText(f"Pipeline of step {timeline.step} ({format_seconds(total)}), one "
                             f"bar per layer: the busiest row bounds the speed")

    def _label_items(self, timeline: Timeline, row: dict, end_ms: float) -> None:
        """Name the compute bars (L0, L1, head...) that are wide enough to read a name in.

        The text items are made once and reused: creating and removing them at every step
        cost the GUI thread 10-20 ms per timeline on the CI machine.
        """
        px_per_s = 1e3 * max(self.plot.getPlotItem().vb.width(), 1.0) / max(end_ms, 1e-9)
        compute = [s for s in timeline.spans if s.lane == "compute"
                   and (s.end - s.start) * px_per_s >= MIN_LABEL_PX]
        while len(self.labels) < len(compute):
            text = pg.TextItem("", color="#ffffff", anchor=(0.5, 0.5))
            text.setFont(QFont(QFont().family(), 7))
            self.plot.addItem(text)
            self.labels.append(text)
        for label, s in zip(self.labels, compute):
            label.setText(s.item.replace("layer", "L"))
            label.setPos((s.start + s.end) / 2 * 1e3, row["compute"])
            label.setVisible(True)
        for label in self.labels[len(compute):]:
            label.setVisible(False)

    def clear(self) -> None:
        self.bars.setOpts(x0=[], x1=[], y0=[], y1=[], brushes=[])
        for label in self.labels:
            label.setVisible(False)
        self.step = None
        self.plot.hide()
