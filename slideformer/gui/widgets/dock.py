"""A dock that collapses to a narrow strip at the window's edge and expands again from it.

Hiding a dock (its close button, View > Monitor) takes it off screen; collapsing keeps it in
sight as a strip :data:`STRIP_PX` wide, named in vertical text, that a click expands to the
width it had. The dock's own title bar (title, collapse, float and close buttons) replaces
Qt's, so that the collapse button sits where people look for a dock's controls.
"""
from __future__ import annotations

from PySide6.QtCore import QSize, Qt, Signal
from PySide6.QtGui import QAction, QPainter
from PySide6.QtWidgets import (QDockWidget, QHBoxLayout, QLabel, QMainWindow, QStyle,
                               QToolButton, QVBoxLayout, QWidget)

STRIP_PX = 30
"""Width of the collapsed dock: one tool button."""
QT_MAX = 16777215
"""Qt's QWIDGETSIZE_MAX: no maximum width."""


class VerticalTitle(QWidget):
    """The dock's title written bottom to top, the height of its text; a click expands."""

    clicked = Signal()

    def __init__(self, text: str, parent=None):
        super().__init__(parent)
        self.text = text
        self.setCursor(Qt.CursorShape.PointingHandCursor)

    def sizeHint(self) -> QSize:
        m = self.fontMetrics()
        return QSize(m.height() + 4, m.horizontalAdvance(self.text) + 12)

    def minimumSizeHint(self) -> QSize:
        return self.sizeHint()

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        p.setPen(self.palette().windowText().color())
        p.translate(self.width() / 2 + self.fontMetrics().ascent() / 2 - 1, self.height() - 6)
        p.rotate(-90)
        p.drawText(0, 0, self.text)

    def mouseReleaseEvent(self, event) -> None:
        self.clicked.emit()


def _tool_button(tip: str, parent: QWidget) -> QToolButton:
    button = QToolButton(parent)
    button.setToolTip(tip)
    button.setAutoRaise(True)
    return button


class CollapsibleDock(QDockWidget):
    """A QDockWidget whose :attr:`collapse_action` (checkable) folds it to a strip."""

    def __init__(self, title: str, content: QWidget, width: int, min_width: int,
                 parent: QMainWindow):
        super().__init__(title, parent)
        self._width, self._min_width = width, min_width
        self.collapse_action = QAction(f"Collapse the {title}", self, checkable=True)
        self.collapse_action.setToolTip(f"Fold the {title} to a strip at the window's edge")
        self.collapse_action.toggled.connect(self._set_collapsed)
        self.title_bar = self._build_title_bar(title)
        self._no_title = QWidget(self)
        """The collapsed dock's title bar: a hairline (the strip names the dock)."""
        self._no_title.setFixedHeight(2)
        self._no_title.hide()
        self.setTitleBarWidget(self.title_bar)
        self.strip = self._build_strip(title)
        self.content = content
        box = QWidget()
        lay = QHBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.setSpacing(0)
        lay.addWidget(content, 1)
        lay.addWidget(self.strip)
        self.strip.hide()  # hidden widgets ask for no room: the strip's narrow, the content not
        self.setWidget(box)
        self.setMinimumWidth(min_width)

    def _build_title_bar(self, title: str) -> QWidget:
        bar = QWidget(self)
        bar.setObjectName("dockTitle")
        name = QLabel(title)
        name.setObjectName("chartTitle")
        collapse = _tool_button(self.collapse_action.toolTip(), bar)
        collapse.setArrowType(Qt.ArrowType.RightArrow)
        collapse.clicked.connect(lambda: self.collapse_action.setChecked(True))
        float_button = _tool_button("Float in a window of its own, or dock again", bar)
        float_button.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_TitleBarNormalButton))
        float_button.clicked.connect(lambda: self.setFloating(not self.isFloating()))
        close = _tool_button("Hide (View > Monitor shows it again)", bar)
        close.setIcon(self.style().standardIcon(QStyle.StandardPixmap.SP_TitleBarCloseButton))
        close.clicked.connect(self.close)
        lay = QHBoxLayout(bar)
        lay.setContentsMargins(8, 2, 2, 2)
        lay.setSpacing(0)
        lay.addWidget(name, 1)
        for button in (collapse, float_button, close):
            lay.addWidget(button)
        self.collapse_button = collapse
        return bar

    def _build_strip(self, title: str) -> QWidget:
        strip = QWidget(self)
        strip.setObjectName("dockStrip")
        strip.setFixedWidth(STRIP_PX)
        self.expand_button = _tool_button(f"Expand the {title}", strip)
        self.expand_button.setArrowType(Qt.ArrowType.LeftArrow)
        self.expand_button.clicked.connect(lambda: self.collapse_action.setChecked(False))
        self.vertical_title = VerticalTitle(title, strip)
        self.vertical_title.setToolTip(f"Expand the {title}")
        self.vertical_title.clicked.connect(lambda: self.collapse_action.setChecked(False))
        lay = QVBoxLayout(strip)
        lay.setContentsMargins(0, 4, 0, 4)
        lay.addWidget(self.expand_button, 0, Qt.AlignmentFlag.AlignHCenter)
        lay.addWidget(self.vertical_title, 0, Qt.AlignmentFlag.AlignHCenter)
        lay.addStretch(1)
        return strip

    @property
    def collapsed(self) -> bool:
        return self.collapse_action.isChecked()

    def _set_collapsed(self, collapsed: bool) -> None:
        window = self.parentWidget()
        if collapsed:
            if self.width() > STRIP_PX:
                self._width = self.width()  # expanding gives it back
            self.content.hide()
            self.title_bar.hide()
            self.setTitleBarWidget(self._no_title)
            self.strip.show()
            self.setMinimumWidth(STRIP_PX)
            self.setMaximumWidth(STRIP_PX)
        else:
            self.strip.hide()
            self.setTitleBarWidget(self.title_bar)
            self.title_bar.show()
            self.content.show()
            self.setMinimumWidth(self._min_width)
            self.setMaximumWidth(QT_MAX)
            if isinstance(window, QMainWindow) and not self.isFloating():
                window.resizeDocks([self], [self._width], Qt.Orientation.Horizontal)
