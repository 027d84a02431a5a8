"""Horizontal stacked bars with a limit line, drawn with QPainter, and the colour legend.

:class:`StackedBars` draws :class:`~slideformer.gui.pages.plan.rows.Row` values as they are: one bar
per row, its segments side by side, a dashed line at the row's limit and the part beyond it
hatched red. Hovering a segment shows its tooltip. Each row has its own scale (a tier against its
own budget), or all rows share one (resources against one step time).
"""
from __future__ import annotations

import html
from typing import NamedTuple

from PySide6.QtCore import QEvent, QPointF, QRectF, QSize, Qt
from PySide6.QtGui import QBrush, QColor, QFont, QFontMetrics, QPainter, QPalette, QPen
from PySide6.QtWidgets import QLabel, QSizePolicy, QToolTip, QWidget

from slideformer.gui.pages.plan.rows import CATEGORIES, Row, Segment


class _Look(NamedTuple):
    """Colours and fonts of one paint."""
    text: QColor
    faint: QColor
    track: QColor
    base: QColor
    bold: QFont
    small: QFont
    italic: QFont
    tiny: QFont


STATE_COLORS = {"ok": "#16a34a", "tight": "#d97706", "over": "#dc2626", "bound": "#ea580c"}
OVER_COLOR = "#dc2626"


class StackedBars(QWidget):
    """Rows of stacked horizontal bars (see the module docstring)."""

    def __init__(self, row_height: int = 54, bar_height: int = 22, title_width: int = 150,
                 shared_scale: bool = False, parent=None):
        super().__init__(parent)
        self.rows: tuple[Row, ...] = ()
        self._row_h, self._bar_h, self._title_w = row_height, bar_height, title_width
        self._shared = shared_scale
        self._right_w, self._top = 52, 16
        self._hover: Segment | None = None
        self.setMouseTracking(True)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setMinimumWidth(title_width + self._right_w + 160)

    def set_rows(self, rows: tuple[Row, ...]) -> None:
        if rows == self.rows:
            return
        resized = len(rows) != len(self.rows)
        self.rows, self._hover = rows, None
        if resized:
            self.updateGeometry()
        self.update()

    def sizeHint(self) -> QSize:
        return QSize(640, self._top + self._row_h * max(1, len(self.rows)) + 4)

    def minimumSizeHint(self) -> QSize:
        return QSize(self.minimumWidth(), self.sizeHint().height())

    # ---- geometry -----------------------------------------------------------------------------
    def _bar_rect(self, i: int) -> QRectF:
        y = self._top + i * self._row_h + (self._row_h - self._bar_h) / 2
        width = max(1.0, self.width() - self._title_w - self._right_w - 8)
        return QRectF(self._title_w, y, width, self._bar_h)

    def _scale(self, row: Row) -> float:
        """The value drawn as the full bar width."""
        rows = self.rows if self._shared else (row,)
        return max((max(r.limit or 0.0, sum(s.value for s in r.segments)) for r in rows),
                   default=0.0)

    def segment_rects(self) -> list[tuple[QRectF, Segment]]:
        """Where each segment is drawn, in widget coordinates."""
        out = []
        for i, row in enumerate(self.rows):
            bar, full = self._bar_rect(i), self._scale(row)
            x = bar.left()
            for seg in row.segments:
                w = bar.width() * seg.value / full if full else 0.0
                out.append((QRectF(x, bar.top(), w, bar.height()), seg))
                x += w
        return out

    def segment_at(self, pos: QPointF) -> Segment | None:
        return next((s for r, s in self.segment_rects() if r.width() > 0 and r.contains(pos)), None)

    # ---- painting -----------------------------------------------------------------------------
    def _look(self) -> _Look:
        """Colours and fonts of one paint, made once (the bars repaint on every plan)."""
        pal = self.palette()
        text = pal.color(QPalette.ColorRole.WindowText)
        faint, track = QColor(text), QColor(text)
        faint.setAlpha(150)
        track.setAlpha(22)

        def font(bold=False, italic=False, delta=0.0) -> QFont:
            f = QFont(self.font())
            f.setBold(bold)
            f.setItalic(italic)
            if delta:
                f.setPointSizeF(f.pointSizeF() + delta)
            return f

        return _Look(text, faint, track, pal.color(QPalette.ColorRole.Base), font(bold=True),
                     font(delta=-1), font(italic=True), font(delta=-1.5))

    def paintEvent(self, event) -> None:
        p = QPainter(self)
        look = self._look()
        for i, row in enumerate(self.rows):
            self._paint_titles(p, i, row, look)
            bar, full = self._bar_rect(i), self._scale(row)
            limit_x = bar.left() + bar.width() * row.limit / full if row.limit and full else bar.right()
            p.setPen(Qt.PenStyle.NoPen)
            p.setBrush(look.track)
            p.drawRoundedRect(QRectF(bar.left(), bar.top(), limit_x - bar.left(), bar.height()), 3, 3)
            if row.empty:
                p.setPen(look.faint)
                p.setFont(look.italic)
                p.drawText(bar.adjusted(8, 0, 0, 0), Qt.AlignmentFlag.AlignVCenter, row.empty)
        p.setFont(look.small)
        metrics = QFontMetrics(look.small)
        for rect, seg in self.segment_rects():
            self._paint_segment(p, rect, seg, look, metrics)
        for i, row in enumerate(self.rows):
            self._paint_limit(p, i, row, look)

    def _paint_titles(self, p: QPainter, i: int, row: Row, look: _Look) -> None:
        top, h = self._top + i * self._row_h, self._row_h
        lines = [line for line in row.subtitle.split("\n") if line]
        title_h, sub_h = QFontMetrics(look.bold).height(), QFontMetrics(look.small).height()
        y = top + (h - title_h - sub_h * len(lines)) / 2
        p.setPen(look.text)
        p.setFont(look.bold)
        p.drawText(QRectF(0, y, self._title_w - 10, title_h), Qt.AlignmentFlag.AlignLeft, row.title)
        p.setPen(look.faint)
        p.setFont(look.small)
        for k, line in enumerate(lines):
            p.drawText(QRectF(0, y + title_h + k * sub_h, self._title_w - 10, sub_h),
                       Qt.AlignmentFlag.AlignLeft, line)
        if row.right:
            bar = self._bar_rect(i)
            p.setPen(QColor(STATE_COLORS[row.state]) if row.state in STATE_COLORS else look.text)
            p.setFont(look.bold)
            p.drawText(QRectF(bar.right() + 8, bar.top(), self._right_w, bar.height()),
                       Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter, row.right)

    def _paint_segment(self, p: QPainter, rect: QRectF, seg: Segment, look: _Look,
                       metrics: QFontMetrics) -> None:
        if rect.width() <= 0:
            return
        p.setPen(Qt.PenStyle.NoPen)
        p.setBrush(QColor(seg.color))
        p.drawRect(rect)
        if rect.width() > 3:  # a hairline between neighbours of one colour group
            p.setPen(QPen(look.base, 1))
            p.drawLine(QPointF(rect.right(), rect.top()), QPointF(rect.right(), rect.bottom()))
        if seg is self._hover:
            p.setPen(QPen(look.text, 2))
            p.setBrush(Qt.BrushStyle.NoBrush)
            p.drawRect(rect.adjusted(1, 1, -1, -1))
        for label in (seg.label, seg.short):
            if label and metrics.horizontalAdvance(label) + 10 <= rect.width():
                p.setPen(QColor("#ffffff"))
                p.drawText(rect.adjusted(5, 0, -3, 0), Qt.AlignmentFlag.AlignVCenter, label)
                break

    def _paint_limit(self, p: QPainter, i: int, row: Row, look: _Look) -> None:
        bar, full = self._bar_rect(i), self._scale(row)
        if not row.limit or not full:
            return
        x = bar.left() + bar.width() * row.limit / full
        total = sum(s.value for s in row.segments)
        over = total > row.limit
        if over:  # the part that does not fit, hatched
            end = bar.left() + bar.width() * total / full
            p.setPen(QPen(QColor(OVER_COLOR), 1.5))
            p.setBrush(QBrush(QColor(OVER_COLOR), Qt.BrushStyle.BDiagPattern))
            p.drawRect(QRectF(x, bar.top(), end - x, bar.height()).adjusted(0, 0.75, -0.75, -0.75))
        color = QColor(OVER_COLOR) if over else look.text
        p.setPen(QPen(color, 2, Qt.PenStyle.DashLine))
        p.drawLine(QPointF(x, bar.top() - 5), QPointF(x, bar.bottom() + 5))
        if self._shared and i:
            return  # one shared line is labelled once
        metrics = QFontMetrics(look.tiny)
        w, h = metrics.horizontalAdvance(row.limit_label) + 4, metrics.height()
        p.setFont(look.tiny)
        p.setPen(color)
        p.drawText(QRectF(x - w, bar.top() - 5 - h, w, h),
                   Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignBottom, row.limit_label)

    # ---- hover --------------------------------------------------------------------------------
    def tooltip_at(self, pos: QPointF) -> str:
        seg = self.segment_at(pos)
        return seg.tooltip if seg is not None else ""

    def event(self, e) -> bool:
        if e.type() == QEvent.Type.ToolTip:
            tip = self.tooltip_at(QPointF(e.pos()))
            if tip:
                QToolTip.showText(e.globalPos(), tip, self)
            else:
                QToolTip.hideText()
                e.ignore()
            return True
        return super().event(e)

    def mouseMoveEvent(self, e) -> None:
        seg = self.segment_at(e.position())
        if seg is not self._hover:
            self._hover = seg
            self.update()

    def leaveEvent(self, e) -> None:
        if self._hover is not None:
            self._hover = None
            self.update()


def legend() -> QLabel:
    """The colour groups of the memory bars, one line that wraps; each named in its tooltip."""
    chip = '<span style="color:{}; font-size:13pt">&#9632;</span>&nbsp;{}'
    items = [chip.format(color, html.escape(name).replace(" ", "&nbsp;"))
             for name, color, _ in CATEGORIES]
    items.append('<span style="color:#dc2626; font-size:13pt">&#9636;</span>&nbsp;over&nbsp;budget')
    label = QLabel("&nbsp;&nbsp; ".join(items))  # breaks only between items
    label.setTextFormat(Qt.TextFormat.RichText)
    label.setWordWrap(True)
    label.setToolTip("<br>".join(f"<b>{html.escape(name)}</b>: {html.escape(what)}"
                                 for name, _, what in CATEGORIES))
    return label
