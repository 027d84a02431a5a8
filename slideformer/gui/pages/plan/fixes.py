"""The planner's fixes as one-click buttons, each with what it changes, saves and costs.

Rows are made once and reused as the fixes change (new widgets are polished against the app's
style sheet, which costs the GUI thread milliseconds per plan while a slider moves).
"""
from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QGridLayout, QLabel, QPushButton, QWidget

from slideformer.engine.api import Fix
from slideformer.gui.models.formatting import human_bytes
from slideformer.gui.pages.plan.rows import TIER_TITLES


def fix_text(fix: Fix) -> str:
    """A fix in words: the change, what it saves, and whether it is enough."""
    parts = [f"saves {human_bytes(fix.saves)} of {TIER_TITLES[fix.tier]}",
             "makes it fit" if fix.fits else "not enough on its own"]
    if not fix.exact:
        parts.append("changes the numerics")
    if fix.tokens_per_s:
        parts.append(f"{fix.tokens_per_s:,.0f} tokens/s")
    if not fix.available:
        parts.append("not available yet")
    return f"{fix.change}: {', '.join(parts)}"


class FixList(QWidget):
    """Fixes, cheapest first; the first that makes the run fit is the highlighted one."""

    chosen = Signal(object)
    """A fix's button was clicked (the :class:`~slideformer.engine.plan.Fix`)."""

    def __init__(self, can_apply, parent=None):
        """``can_apply(settings)``: whether the page has an input for every key of a fix."""
        super().__init__(parent)
        self._can_apply = can_apply
        self.fixes: tuple[Fix, ...] = ()
        self._rows: list[tuple[QPushButton, QLabel]] = []
        self._grid = QGridLayout(self)
        self._grid.setContentsMargins(0, 0, 0, 0)
        self._grid.setColumnStretch(1, 1)
        self._head = QLabel("<b>Fixes, cheapest first:</b>")
        self._grid.addWidget(self._head, 0, 0, 1, 2)
        self.hide()

    def set_fixes(self, fixes: tuple[Fix, ...]) -> None:
        if fixes == self.fixes:
            return
        self.fixes = fixes
        while len(self._rows) < len(fixes):
            self._add_row()
        first = next((f for f in fixes if f.fits and f.available), None)
        for i, (button, text) in enumerate(self._rows):
            shown = i < len(fixes)
            button.setVisible(shown)
            text.setVisible(shown)
            if shown:
                self._show(button, text, fixes[i], fixes[i] is first)
        self.setVisible(bool(fixes))

    def _add_row(self) -> None:
        i = len(self._rows)
        button = QPushButton()
        button.setMinimumWidth(170)
        button.clicked.connect(lambda: self.chosen.emit(self.fixes[i]))
        text = QLabel()
        text.setWordWrap(True)
        self._grid.addWidget(button, i + 1, 0)
        self._grid.addWidget(text, i + 1, 1)
        self._rows.append((button, text))

    def _show(self, button: QPushButton, text: QLabel, fix: Fix, primary: bool) -> None:
        button.setText(fix.name)
        usable = fix.available and self._can_apply(fix.settings)
        button.setEnabled(usable)
        button.setToolTip("Apply: " + ", ".join(f"{k} = {v}" for k, v in fix.settings) if usable
                          else "The engine cannot do this yet" if not fix.available
                          else "This page has no input for it")
        name = "primary" if primary else ""
        if button.objectName() != name:
            button.setObjectName(name)
            button.style().unpolish(button)  # restyle for the new name
            button.style().polish(button)
        text.setText(fix_text(fix))

    def buttons(self) -> list[QPushButton]:
        """The buttons on screen, in the fixes' order."""
        return [button for button, _ in self._rows[:len(self.fixes)]]
