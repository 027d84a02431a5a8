"""The models found on this machine as a table: one row per
:class:`~slideformer.engine.api.FoundModel`, the columns people compare them by.

A Qt item model (tested without a view): each cell's text, its tooltip (the planner's reason
for a verdict, the engine's message for a model it cannot train) and its colour (a verdict's;
grey for a model it cannot train).
"""
from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QAbstractTableModel, QModelIndex, Qt
from PySide6.QtGui import QBrush, QColor

from slideformer.engine.api import Fit, FoundModel
from slideformer.gui.models.fit import METHODS, VERDICT_STATES, VERDICT_TITLES
from slideformer.gui.models.formatting import home_relative, human_bytes, human_count, short_path
from slideformer.gui.widgets.bars import STATE_COLORS

SOURCE_TITLES = {"hf-cache": "HF cache", "ollama": "Ollama", "lm-studio": "LM Studio",
                 "folder": "Folder"}
UNSUPPORTED_COLOR = "#9ca3af"
"""Text of a model the engine cannot train (readable on the light and the dark theme)."""
CONFIG_ONLY = "config only"
FIT_HEADINGS = {"full": "Full", "lora": "LoRA", "qlora": "QLoRA"}
"""The verdict columns' headings (the table is narrow; their tooltips name the method)."""


def _params(m: FoundModel) -> str:
    if m.total_params is None:
        return "—"
    if m.active_params == m.total_params:
        return human_count(m.total_params)
    return f"{human_count(m.total_params)} ({human_count(m.active_params)})"


def _fit(m: FoundModel, method: str) -> Fit | None:
    return next((f for f in m.fits if f.method == method), None)


def _fit_text(m: FoundModel, method: str) -> str:
    f = _fit(m, method)
    return "—" if f is None else VERDICT_TITLES[f.verdict] if f.verdict else "No plan"


COLUMNS: tuple[tuple[str, Callable[[FoundModel], str]], ...] = (
    ("Name", lambda m: m.name),
    ("Source", lambda m: SOURCE_TITLES[m.source]),
    ("Family", lambda m: m.family or "—"),
    ("Parameters", _params),
    ("Type", lambda m: m.dtype or "—"),
    ("Size", lambda m: CONFIG_ONLY if m.config_only else human_bytes(m.size)),
    *((FIT_HEADINGS[method], lambda m, method=method: _fit_text(m, method))
      for method, _ in METHODS),
)
"""(heading, text of a row): the table's columns, the last three the methods' verdicts."""
HEADING_TIPS = {"Parameters": "All parameters (and, for a mixture of experts, those a token "
                              "computes with)", **{FIT_HEADINGS[m]: t for m, t in METHODS}}
FIT_COLUMNS = {len(COLUMNS) - len(METHODS) + i: method for i, (method, _) in enumerate(METHODS)}
"""Column -> the method whose verdict it shows."""


def tooltip(m: FoundModel, column: int) -> str:
    """What a cell's tooltip says: where the model is, and why it cannot be trained or what the
    planner said of its method."""
    if not m.supported:
        return f"Cannot be trained here:\n{home_relative(m.reason)}"
    method = FIT_COLUMNS.get(column)
    if method is not None and (f := _fit(m, method)) is not None:
        return home_relative(f.reason)
    note = ("\nconfig.json only: the weights are not downloaded yet, so it can be planned, "
            "not trained" if m.config_only else "")
    active = (f", {human_count(m.active_params)} active per token"
              if m.active_params != m.total_params else "")
    return (f"{short_path(m.path)}\n{human_count(m.total_params)} parameters{active}, "
            f"{human_bytes(m.size)} on disk{note}")


class FoundModels(QAbstractTableModel):
    """The rows of the last scan, in the engine's order (store by store, by name)."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.rows: list[FoundModel] = []

    def set_rows(self, rows: list[FoundModel]) -> None:
        self.beginResetModel()
        self.rows = list(rows)
        self.endResetModel()

    def found(self, row: int) -> FoundModel:
        return self.rows[row]

    def rowCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(self.rows)

    def columnCount(self, parent=QModelIndex()) -> int:
        return 0 if parent.isValid() else len(COLUMNS)

    def headerData(self, section, orientation, role=Qt.ItemDataRole.DisplayRole):
        if orientation != Qt.Orientation.Horizontal:
            return None
        if role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[section][0]
        if role == Qt.ItemDataRole.ToolTipRole:
            return HEADING_TIPS.get(COLUMNS[section][0])
        return None

    def data(self, index: QModelIndex, role=Qt.ItemDataRole.DisplayRole):
        if not index.isValid():
            return None
        m = self.rows[index.row()]
        if role == Qt.ItemDataRole.DisplayRole:
            return COLUMNS[index.column()][1](m)
        if role == Qt.ItemDataRole.ToolTipRole:
            return tooltip(m, index.column())
        if role == Qt.ItemDataRole.ForegroundRole:
            return self._color(m, index.column())
        return None

    @staticmethod
    def _color(m: FoundModel, column: int) -> QBrush | None:
        if not m.supported:
            return QBrush(QColor(UNSUPPORTED_COLOR))
        method = FIT_COLUMNS.get(column)
        f = _fit(m, method) if method else None
        if f is None or f.verdict is None:
            return None
        return QBrush(QColor(STATE_COLORS[VERDICT_STATES[f.verdict]]))
