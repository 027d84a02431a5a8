"""The Model page's "On this machine" box: the models already here (the Hugging Face cache,
Ollama, LM Studio, the folders added here), what each is and which training methods fit it.

The scan (:func:`slideformer.engine.api.discover_models`: config.json files and GGUF headers
only, each model planned three times) runs in the app's planner process, waited for on a worker
thread (:mod:`slideformer.gui.workers.planner` says why not on a thread of the app): when the
page is first shown, on Rescan, and when a folder joins or leaves the search; a request during
a scan is run after it. The stores scanned are read here (:func:`model_roots`: the app's
environment, not the planner process's).
Picking a row (double-click, Enter or Use) emits :attr:`FoundBox.picked`. Greyed rows cannot be
trained here: their tooltip and the line under the table say why, in the engine's words.
"""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QItemSelection, Qt, Signal
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QGroupBox, QHBoxLayout,
                               QHeaderView, QLabel, QMenu, QPushButton, QTableView, QVBoxLayout)

from slideformer.engine.api import FoundModel, ModelRoots, discover_models, model_roots
from slideformer.gui.context import AppContext
from slideformer.gui.models.formatting import home_relative, short_path
from slideformer.gui.models.found import FoundModels, tooltip
from slideformer.gui.widgets.common import ElidedLabel
from slideformer.gui.workers.planner import shared_planner
from slideformer.gui.workers.thread import run_task

NONE_FOUND = ("None found in the Hugging Face cache, Ollama or LM Studio: add a folder that "
              "holds model folders or .gguf files.")


def scan(folders: tuple[str, ...], roots: ModelRoots) -> tuple[list[FoundModel], float]:
    """The models of the stores ``roots`` and of ``folders``, and the seconds the scan took,
    found by the planner process (call it off the GUI thread: it waits for the answer)."""
    start = time.perf_counter()
    rows = shared_planner().call(discover_models, folders, roots)
    return rows, time.perf_counter() - start


class FoundBox(QGroupBox):
    """The table of the models found, with Use, Rescan and Add folder."""

    picked = Signal(object)
    """A supported row was chosen (its :class:`~slideformer.engine.api.FoundModel`)."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__("On this machine", parent)
        self.ctx = ctx
        self.found = FoundModels(self)
        self.scans = 0
        """Scans finished (their rows are on screen)."""
        self._scanning = False
        self._again = False
        """Scan once more when this one ends (the folders changed meanwhile)."""

        self.table = self._build_table()
        self.use_button = QPushButton("Use")
        self.use_button.setObjectName("primary")
        self.use_button.setToolTip("Open the selected model (a GGUF file is imported first) and "
                                   "plan it")
        self.use_button.setEnabled(False)
        self.use_button.clicked.connect(self._use_selected)
        self.rescan_button = QPushButton("Rescan")
        self.rescan_button.clicked.connect(self.rescan)
        self.add_button = QPushButton("Add folder…")
        self.add_button.setToolTip("Also search a folder of yours (a model folder, or one holding "
                                   "model folders or .gguf files);\nright-click the table to "
                                   "stop searching it")
        self.add_button.clicked.connect(self.choose_folder)
        self.status = QLabel("")
        self.status.setObjectName("hint")
        self.status.setWordWrap(True)
        self.detail = ElidedLabel()
        self.detail.setObjectName("hint")

        row = QHBoxLayout()
        for button in (self.use_button, self.rescan_button, self.add_button):
            row.addWidget(button)
        row.addWidget(self.status, 1)
        lay = QVBoxLayout(self)
        lay.addLayout(row)
        lay.addWidget(self.table, 1)
        lay.addWidget(self.detail)

    def _build_table(self) -> QTableView:
        table = QTableView()
        table.setObjectName("foundTable")
        table.setModel(self.found)
        table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        table.setSelectionMode(QAbstractItemView.SelectionMode.SingleSelection)
        table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        table.setShowGrid(False)
        table.setWordWrap(False)
        table.setTextElideMode(Qt.TextElideMode.ElideLeft)  # "org/" goes first, the model last
        table.verticalHeader().hide()
        table.verticalHeader().setDefaultSectionSize(table.fontMetrics().height() + 8)
        header = table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setHighlightSections(False)
        table.activated.connect(lambda index: self._pick(self.found.found(index.row())))
        table.selectionModel().selectionChanged.connect(self._selected)
        table.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        table.customContextMenuRequested.connect(self._folders_menu)
        return table

    # ---- scanning ------------------------------------------------------------------------
    def showEvent(self, event) -> None:
        super().showEvent(event)
        if self.scans == 0 and not self._scanning:
            self.rescan()

    def rescan(self) -> None:
        """Scan again on a worker thread (after the scan under way, if one is)."""
        if self._scanning:
            self._again = True
            return
        self._scanning = True
        self.rescan_button.setEnabled(False)
        self.status.setText("Looking for models…")
        run_task(scan, tuple(self.ctx.settings.model_folders()), model_roots(),
                 name="model-discovery", owner=self, done=self._scanned, failed=self._failed)

    def _scanned(self, answer: tuple[list[FoundModel], float]) -> None:
        rows, seconds = answer
        self._finished()
        if self._again:
            self._again = False
            self.rescan()
            return
        self.found.set_rows(rows)
        self.scans += 1
        refused = sum(not r.supported for r in rows)
        if not rows:
            self.status.setText(NONE_FOUND)
        else:
            self.status.setText(f"{len(rows)} models ({seconds:.1f} s)"
                                + (f"; {refused} greyed: not trainable here" if refused else ""))
        self._selected()

    def _failed(self, message: str) -> None:
        self._finished()
        self.status.setText(f"The scan failed: {home_relative(message)}")

    def _finished(self) -> None:
        self._scanning = False
        self.rescan_button.setEnabled(True)

    # ---- folders -------------------------------------------------------------------------
    def choose_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a folder to search for models",
                                                str(Path.home()))
        if path:
            self.add_folder(path)

    def add_folder(self, path: str) -> None:
        self.ctx.settings.add_model_folder(str(Path(path).expanduser().absolute()))
        self.rescan()

    def _folders_menu(self, pos) -> None:
        folders = self.ctx.settings.model_folders()
        if not folders:
            return
        menu = QMenu(self)
        actions = {menu.addAction(f"Stop searching {short_path(f)}"): f for f in folders}
        chosen = menu.exec(self.table.viewport().mapToGlobal(pos))
        if chosen in actions:
            self.ctx.settings.remove_model_folder(actions[chosen])
            self.rescan()

    # ---- choosing ------------------------------------------------------------------------
    def selected(self) -> FoundModel | None:
        rows = self.table.selectionModel().selectedRows()
        return self.found.found(rows[0].row()) if rows else None

    def _selected(self, *_args: QItemSelection) -> None:
        m = self.selected()
        self.use_button.setEnabled(m is not None and m.supported)
        self.detail.set_full_text("" if m is None else tooltip(m, 0).replace("\n", "  ·  ")
                                  if m.supported else home_relative(m.reason).replace("\n", " "))

    def _use_selected(self) -> None:
        m = self.selected()
        if m is not None:
            self._pick(m)

    def _pick(self, m: FoundModel) -> None:
        if m.supported:
            self.picked.emit(m)
