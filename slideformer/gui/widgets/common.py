"""Small pieces every page uses: the page header, its row of actions and state-styled labels."""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt
from PySide6.QtWidgets import (QFrame, QHBoxLayout, QLabel, QScrollArea, QSizePolicy, QVBoxLayout,
                               QWidget)


def page_header(title: str, subtitle: str) -> QWidget:
    """A page's title and one sentence on what the page is for."""
    box = QWidget()
    lay = QVBoxLayout(box)
    lay.setContentsMargins(0, 0, 0, 4)
    lay.setSpacing(2)
    t = QLabel(title)
    t.setObjectName("pageTitle")
    s = QLabel(subtitle)
    s.setObjectName("pageSubtitle")
    s.setWordWrap(True)
    lay.addWidget(t)
    lay.addWidget(s)
    return box


def action_row(buttons: tuple[QWidget, ...], hint: str, busy: QWidget) -> QHBoxLayout:
    """A page's row of actions: its buttons, a ``hint`` after them, ``busy`` at the far end."""
    row = QHBoxLayout()
    for button in buttons:
        row.addWidget(button)
    label = QLabel(hint)
    label.setObjectName("hint")
    row.addWidget(label)
    row.addStretch(1)
    row.addWidget(busy)
    return row


def status_label(text: str = "") -> QLabel:
    """A wrapped, selectable plain-text label styled by its state (see :func:`set_state`)."""
    label = QLabel(text)
    label.setObjectName("status")
    label.setWordWrap(True)
    label.setTextFormat(Qt.TextFormat.PlainText)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
    return label


def set_state(widget: QWidget, state: str) -> None:
    """Set the ``state`` property the style sheets key on (info, busy, ok, error) and restyle."""
    widget.setProperty("state", state)
    widget.style().unpolish(widget)
    widget.style().polish(widget)


def fixed_width(label: QLabel) -> QLabel:
    """Let ``label`` take the width its layout gives it, whatever its text.

    A label that changes its text many times a second (a live value) would otherwise ask for a
    new layout each time, and the whole page around it would be laid out and repainted.
    """
    policy = label.sizePolicy()
    policy.setHorizontalPolicy(QSizePolicy.Policy.Ignored)
    label.setSizePolicy(policy)
    return label


def color_plot(plot, background: str, foreground: str) -> None:
    """Theme a pyqtgraph PlotWidget: background, and pen, tick values and name of its left and
    bottom axes (a name left in the default grey is unreadable on the dark background)."""
    import pyqtgraph as pg
    plot.setBackground(background)
    for name in ("left", "bottom"):
        axis = plot.getPlotItem().getAxis(name)
        axis.setPen(pg.mkPen(foreground))
        axis.setTextPen(pg.mkPen(foreground))
        if axis.labelText:
            axis.setLabel(axis.labelText, color=foreground)



class ColumnScroll(QScrollArea):
    """A scroll area for a column of forms: it scrolls up and down, never sideways, and its
    least width is what its content needs (also after a style sheet or font changed that)."""

    def __init__(self, content: QWidget, parent=None):
        super().__init__(parent)
        self.setWidget(content)
        self.setWidgetResizable(True)
        self.setFrameShape(QFrame.Shape.NoFrame)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

    def minimumSizeHint(self) -> QSize:
        inner = self.widget().minimumSizeHint().width()
        bar = self.verticalScrollBar().sizeHint().width()
        return QSize(inner + bar + 2 * self.frameWidth(), super().minimumSizeHint().height())


class ElidedLabel(QLabel):
    """One line of text shortened in the middle ("~/.ollama/…/sha256-17c3") to the width its
    layout gives it; the whole text is its tooltip. It never widens the page around it."""

    def __init__(self, text: str = "", parent=None):
        super().__init__(parent)
        self._full = ""
        self.setSizePolicy(QSizePolicy.Policy.Ignored, QSizePolicy.Policy.Preferred)
        self.set_full_text(text)

    def set_full_text(self, text: str) -> None:
        self._full = text
        self.setToolTip(text)
        self._elide()

    def full_text(self) -> str:
        return self._full

    def minimumSizeHint(self) -> QSize:
        return QSize(0, super().minimumSizeHint().height())

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._elide()

    def _elide(self) -> None:
        self.setText(self.fontMetrics().elidedText(self._full, Qt.TextElideMode.ElideMiddle,
                                                   max(self.width(), 0)))
