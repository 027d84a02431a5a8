"""The Data page's histogram of record lengths, with the sequence length as a line."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt

from slideformer.engine.api import DataConfig, DataStats
from slideformer.gui.widgets.common import color_plot

TRUNCATED_COLOR = "#f59e0b"
"""Bars of records longer than the sequence length, and the line at that length."""
BAR_COLOR = "#3b82f6"
AXIS_LABEL = "record length (tokens, before truncation)"
FAR_BEYOND = 4
"""A sequence length this many times the longest record's bin edge is drawn as a note on the
axis, not as a line far to the right of every bar."""


class LengthHistogram(pg.PlotWidget):
    """Record lengths in tokens: bars from DataStats, the sequence length as a line."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setMouseEnabled(x=False, y=False)
        self.hideButtons()
        self.setMenuEnabled(False)
        self._background = "#ffffff"
        self.setBackground(self._background)
        item = self.getPlotItem()
        item.showGrid(y=True, alpha=0.15)
        item.setLabel("bottom", AXIS_LABEL)
        item.setLabel("left", "records")
        self.bars = pg.BarGraphItem(x0=[], x1=[], height=[], brush=BAR_COLOR)
        self.addItem(self.bars)
        self.limit = pg.InfiniteLine(angle=90, movable=False,
                                     pen=pg.mkPen(TRUNCATED_COLOR, width=2, style=Qt.DashLine),
                                     label="sequence length", labelOpts={
                                         "position": 0.9, "color": TRUNCATED_COLOR,
                                         "anchors": [(1, 0), (1, 0)]})
        self.addItem(self.limit)
        self.limit.hide()  # until there is data to compare it with
        self.getPlotItem().setXRange(0, DataConfig().max_seq_len, padding=0)
        self.getPlotItem().setYRange(0, 1, padding=0)

    def show_stats(self, stats: DataStats) -> None:
        edges, counts = stats.hist_edges, stats.hist_counts
        brushes = [pg.mkBrush(TRUNCATED_COLOR if lo >= stats.seq_len else BAR_COLOR)
                   for lo in edges[:-1]]
        self.bars.setOpts(x0=list(edges[:-1]), x1=list(edges[1:]), height=list(counts),
                          brushes=brushes, pen=pg.mkPen(self._background, width=1))
        # A sequence length far beyond the longest record would squeeze every bar into the
        # left edge: the axis then spans the records, and its label says that all of them fit.
        far = stats.seq_len > FAR_BEYOND * edges[-1]
        self.limit.setVisible(not far)  # first: a hidden line's label ignores a new text
        self.limit.setPos(stats.seq_len)
        self.limit.label.setFormat(f"sequence length {stats.seq_len}")
        self.getPlotItem().setLabel("bottom", f"{AXIS_LABEL}: all shorter than the sequence "
                                              f"length {stats.seq_len}" if far else AXIS_LABEL)
        right = (edges[-1] if far else max(edges[-1], stats.seq_len)) * 1.05
        self.getPlotItem().setXRange(0, right, padding=0)
        self.getPlotItem().setYRange(0, max(counts, default=1) * 1.1, padding=0)

    def clear_stats(self) -> None:
        self.bars.setOpts(x0=[], x1=[], height=[], brushes=[])
        self.limit.hide()
        self.getPlotItem().setLabel("bottom", AXIS_LABEL)

    def set_colors(self, background: str, foreground: str) -> None:
        self._background = background  # bar outlines: gaps between bars, not white frames
        self.bars.setOpts(pen=pg.mkPen(background, width=1))
        color_plot(self, background, foreground)
