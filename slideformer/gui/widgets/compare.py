"""The Runs page's comparison of chosen runs: their loss curves overlaid, and a table of the
settings they differ in (data from :mod:`slideformer.gui.models.compare`)."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout, QLabel, QTreeWidget, QTreeWidgetItem, QVBoxLayout, QWidget

from slideformer.gui.models.compare import Curve
from slideformer.gui.widgets.chart import line_plot
from slideformer.gui.widgets.common import color_plot

PALETTE = ("#3b82f6", "#f59e0b", "#22c55e", "#ef4444", "#a855f7", "#14b8a6", "#ec4899",
           "#84cc16")
"""One colour per run, in the order chosen (repeats past eight runs)."""


class CompareView(QWidget):
    """Loss over steps of several runs (solid: training, dashed: validation) and the config
    keys whose values differ, one column per run in the curves' colours."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.plot = line_plot(160, 48, 28)
        self.plot.getPlotItem().setLabel("bottom", "step")
        self.plot.getPlotItem().setLabel("left", "loss")
        self.legend = self.plot.getPlotItem().addLegend(offset=(-10, 10))
        self.differences = QTreeWidget()
        self.differences.setRootIsDecorated(False)
        self.differences.setAlternatingRowColors(True)
        self.same = QLabel("")
        self.same.setObjectName("hint")
        right = QVBoxLayout()
        right.setContentsMargins(0, 0, 0, 0)
        right.addWidget(QLabel("Settings that differ (config.toml)"))
        right.addWidget(self.differences, 1)
        right.addWidget(self.same)
        lay = QHBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addWidget(self.plot, 3)
        lay.addLayout(right, 2)

    def set_colors(self, background: str, foreground: str) -> None:
        color_plot(self.plot, background, foreground)

    def show_runs(self, curves: list[Curve], differences: list[tuple[str, list[str]]]) -> None:
        item = self.plot.getPlotItem()
        item.clear()
        self.legend.clear()
        for i, c in enumerate(curves):
            color = PALETTE[i % len(PALETTE)]
            item.plot(list(c.steps), list(c.losses), pen=pg.mkPen(color, width=1.5), name=c.name)
            if c.val_steps:
                item.plot(list(c.val_steps), list(c.val_losses), symbol="o", symbolSize=5,
                          symbolBrush=color, pen=pg.mkPen(color, width=1.5,
                                                          style=Qt.PenStyle.DashLine))
        self.differences.clear()
        self.differences.setColumnCount(1 + len(curves))
        self.differences.setHeaderLabels(["Key", *(c.name for c in curves)])
        header = self.differences.headerItem()
        for i in range(len(curves)):
            header.setForeground(i + 1, pg.mkColor(PALETTE[i % len(PALETTE)]))
        for key, values in differences:
            row = QTreeWidgetItem([key, *values])
            for col, value in enumerate(values, 1):
                row.setToolTip(col, value)
            self.differences.addTopLevelItem(row)
        self.differences.resizeColumnToContents(0)
        self.same.setText("" if differences else "The chosen runs have the same settings.")
