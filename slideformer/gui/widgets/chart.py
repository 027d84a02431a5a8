"""What every live line chart of the app shares (the Train page's metrics, the Monitor's
figures): a head with the chart's title and its newest value, and a plot set up for data that
grows while it is shown."""
from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QFont
from PySide6.QtWidgets import QHBoxLayout, QLabel


def chart_head(title: str, empty: str) -> tuple[QLabel, QLabel, QHBoxLayout]:
    """The title on the left and the newest value (rich text, ``empty`` until there is one) on
    the right, in one row."""
    name = QLabel(title)
    name.setObjectName("chartTitle")
    value = QLabel(empty)
    value.setObjectName("chartValue")
    value.setTextFormat(Qt.TextFormat.RichText)
    value.setAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
    row = QHBoxLayout()
    row.setContentsMargins(0, 0, 0, 0)
    row.addWidget(name)
    row.addWidget(value, 1)
    return name, value, row


def line_plot(min_height: int, left_px: int, bottom_px: int) -> pg.PlotWidget:
    """A plot whose curves get ``setData`` many times a second: no buttons or menu,
    downsampling and clipping to the view on, a faint grid, small major ticks only (the charts
    are short), axes ``left_px`` wide and ``bottom_px`` high."""
    plot = pg.PlotWidget()
    plot.setMinimumHeight(min_height)
    plot.hideButtons()
    plot.setMenuEnabled(False)
    item = plot.getPlotItem()
    item.setDownsampling(auto=True, mode="peak")
    item.setClipToView(True)
    item.showGrid(x=True, y=True, alpha=0.15)
    small_axes(item, left_px, bottom_px)
    return plot


def small_axes(item: pg.PlotItem, left_px: int, bottom_px: int) -> None:
    """Major ticks only, in small print, on axes of a fixed size (a changing tick label would
    otherwise resize the plot)."""
    for name in ("left", "bottom"):
        item.getAxis(name).setStyle(maxTickLevel=0, tickFont=QFont(QFont().family(), 8))
    item.getAxis("left").setWidth(left_px)
    item.getAxis("bottom").setHeight(bottom_px)
