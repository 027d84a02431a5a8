"""The Runs page: every run folder the app knows, live or finished, whoever started it.

The list is the run folders in the app's runs folder plus any folder added by hand (a run
started with ``slideformer train`` elsewhere), read from their files (:mod:`run_files`) on a
worker thread every :data:`REFRESH_MS` while the page is visible. A run can be shown on the Train
page (following it live while its engine runs), resumed from its newest checkpoint, or opened
in the file manager.
"""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, QUrl, Slot
from PySide6.QtGui import QBrush, QColor, QDesktopServices, QFont
from PySide6.QtWidgets import (QAbstractItemView, QFileDialog, QGridLayout, QGroupBox, QHBoxLayout,
                               QHeaderView, QInputDialog, QLabel, QPlainTextEdit, QPushButton,
                               QSplitter, QStackedWidget, QTreeWidget, QTreeWidgetItem, QVBoxLayout,
                               QWidget)

from slideformer.engine.api import GGUF_EXPORT_TYPES, ollama_model_name
from slideformer.gui.context import AppContext
from slideformer.gui.pages.gguf_actions import (export_run_gguf, newest_export,
                                                 send_export_to_ollama)
from slideformer.gui.models.compare import compare
from slideformer.gui.models.formatting import short_path
from slideformer.gui.models.runs import RunSummary, engine_log, is_run_dir, read_config_text, \
    scan_runs, text_tail
from slideformer.gui.workers.thread import run_task
from slideformer.gui.widgets.common import page_header, status_label
from slideformer.gui.widgets.compare import CompareView
from slideformer.gui.theme import PLOT_COLORS

REFRESH_MS = 2000
COLUMNS = ("Run", "Status", "Step", "Loss", "Model", "Data", "Batch and LR", "Last activity")
ELIDED = {"Model": 110, "Data": 110}
"""Columns of names that are elided in the middle at this width (the rest fit their text; Run
takes what is left): every column that tells runs apart stays on a 1366 px screen."""
STATUS_COLORS = {"running": "#16a34a", "setup": "#16a34a", "saving": "#16a34a",
                 "paused": "#d97706", "failed": "#dc2626", "interrupted": "#dc2626",
                 "finished": "#2563eb", "stopped": "#6b7280"}


def ago(t: float) -> str:
    """Seconds since the epoch as "12 s ago", "5 min ago", "3 h ago" or a date."""
    dt = time.time() - t
    if t <= 0:
        return ""
    if dt < 60:
        return f"{max(dt, 0):.0f} s ago"
    if dt < 3600:
        return f"{dt // 60:.0f} min ago"
    if dt < 86400:
        return f"{dt // 3600:.0f} h ago"
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def status_text(s: RunSummary) -> str:
    if s.status == "interrupted":
        return "interrupted" + (f" (resumable from step {s.checkpoint})" if s.checkpoint else "")
    return s.status


class RunsPage(QWidget):
    """The history of runs, with resume, follow and open-folder actions."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.summaries: dict[str, RunSummary] = {}
        self._scanning = False

        self._build_table()
        actions = self._build_actions()
        self.empty = QLabel(f"No runs yet. Runs started here go to {short_path(ctx.runs_dir)}; "
                            f"add a folder to list a run started from a terminal.")
        self.empty.setObjectName("hint")
        self.empty.setWordWrap(True)
        list_box = QWidget()
        ll = QVBoxLayout(list_box)
        ll.setContentsMargins(0, 0, 0, 0)
        ll.addWidget(self.empty)
        ll.addWidget(self.table, 1)
        splitter = QSplitter(Qt.Orientation.Vertical)  # the table gets the page's width
        splitter.addWidget(list_box)
        splitter.addWidget(self._build_details())
        ctx.theme_changed.connect(lambda name: self.compare_view.set_colors(*PLOT_COLORS[name]))
        self.compare_view.set_colors(*PLOT_COLORS[ctx.settings.theme()])
        splitter.setSizes([300, 300])
        splitter.setChildrenCollapsible(False)
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Runs", "Every run in the runs folder, live or finished: "
                                          "follow one as it trains (also runs started from a "
                                          "terminal), resume one from its last checkpoint, or "
                                          "open its folder."))
        lay.addLayout(actions)
        lay.addWidget(splitter, 1)

        self._timer = QTimer(self, interval=REFRESH_MS)
        self._timer.timeout.connect(self._tick)
        self._timer.start()
        self._update_buttons()
        self.refresh()

    def _build_table(self) -> None:
        """One row per run; the columns that tell runs apart fit a 1366 px screen."""
        self.table = QTreeWidget()
        self.table.setColumnCount(len(COLUMNS))
        self.table.setHeaderLabels(COLUMNS)
        self.table.setRootIsDecorated(False)
        self.table.setAlternatingRowColors(True)
        self.table.setUniformRowHeights(True)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.setTextElideMode(Qt.TextElideMode.ElideMiddle)  # names end in their time
        self.table.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        header = self.table.header()
        header.setStretchLastSection(False)
        header.setMinimumSectionSize(48)
        for i, name in enumerate(COLUMNS):
            mode = QHeaderView.ResizeMode.Interactive if name in ELIDED else \
                QHeaderView.ResizeMode.ResizeToContents
            header.setSectionResizeMode(i, QHeaderView.ResizeMode.Stretch if i == 0 else mode)
        for name, width in ELIDED.items():
            header.resizeSection(COLUMNS.index(name), width)
        self.table.itemSelectionChanged.connect(self._selection_changed)
        self.table.itemDoubleClicked.connect(lambda *_: self.show_selected())

    def _build_actions(self) -> QHBoxLayout:
        """What can be done with the selected run, and adding a run folder from elsewhere."""
        self.show_button = QPushButton("Show on Train page")
        self.show_button.setObjectName("primary")
        self.show_button.setToolTip("Plots and messages of the run; a live run is followed as "
                                    "it trains")
        self.show_button.clicked.connect(self.show_selected)
        self.resume_button = QPushButton("Resume")
        self.resume_button.setToolTip("Continue from the newest checkpoint")
        self.resume_button.clicked.connect(self.resume_selected)
        self.open_button = QPushButton("Open folder")
        self.open_button.clicked.connect(self.open_selected)
        self.export_button = QPushButton("Export GGUF…")
        self.export_button.setToolTip("Write the run's final model as a GGUF file (llama.cpp, "
                                      "LM Studio, Ollama)\nwith an Ollama Modelfile, in the run "
                                      "folder")
        self.export_button.clicked.connect(self.export_selected)
        self.ollama_button = QPushButton("Send to Ollama…")
        self.ollama_button.setToolTip("Create an Ollama model from the run's newest GGUF export "
                                      "(ollama create)")
        self.ollama_button.clicked.connect(self.send_selected_to_ollama)
        self._exporting = False
        self.add_button = QPushButton("Add folder…")
        self.add_button.setToolTip("List a run folder from elsewhere (e.g. a terminal run)")
        self.add_button.clicked.connect(self.choose_run_folder)
        actions = QHBoxLayout()
        for w in (self.show_button, self.resume_button, self.open_button, self.export_button,
                  self.ollama_button):
            actions.addWidget(w)
        actions.addStretch(1)
        actions.addWidget(self.add_button)
        return actions

    def _build_details(self) -> QGroupBox:
        """The selected run: where it is, how far it got, its config.toml and its log."""
        self.details_title = QLabel("")
        self.details_title.setObjectName("chartTitle")
        self.details_title.setWordWrap(True)
        self.details_title.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.export_status = status_label("")
        self.export_status.hide()  # shown once an export starts
        self.config_view = QPlainTextEdit()
        self.config_view.setReadOnly(True)
        self.log_view = QPlainTextEdit()
        self.log_view.setReadOnly(True)
        for view in (self.config_view, self.log_view):
            view.setFont(QFont("monospace", 8))
        self.details = QGroupBox("Selected run")
        dl = QVBoxLayout(self.details)
        dl.addWidget(self.details_title)
        dl.addWidget(self.export_status)
        files_box = QWidget()
        files = QGridLayout(files_box)
        files.setContentsMargins(0, 0, 0, 0)
        files.addWidget(QLabel("config.toml"), 0, 0)
        files.addWidget(QLabel("engine.log (last lines)"), 0, 1)
        files.addWidget(self.config_view, 1, 0)
        files.addWidget(self.log_view, 1, 1)
        self.compare_view = CompareView()
        self.detail_pages = QStackedWidget()
        self.detail_pages.addWidget(files_box)
        self.detail_pages.addWidget(self.compare_view)
        dl.addWidget(self.detail_pages, 1)
        return self.details

    # ---- scanning ----------------------------------------------------------------------------
    def roots(self) -> list[Path]:
        return [self.ctx.runs_dir]

    def _tick(self) -> None:
        if self.isVisible():
            self.refresh()

    @Slot()
    def refresh(self) -> None:
        """Read the run folders again (on a worker thread)."""
        if self._scanning:
            return
        self._scanning = True
        extra = [Path(p) for p in self.ctx.settings.extra_runs()]
        run_task(scan_runs, self.roots(), extra, name="scan-runs", owner=self, done=self._show,
                 failed=lambda _msg: setattr(self, "_scanning", False))

    def _show(self, summaries: list[RunSummary]) -> None:
        self._scanning = False
        selected = self.selected_path()
        self.summaries = {str(s.path): s for s in summaries}
        self.table.clear()
        for s in summaries:
            loss = f"{s.loss:.4f}" if s.loss is not None else "—"
            step = f"{s.step:,} / {s.total_steps:,}" if s.total_steps else f"{s.step:,}"
            item = QTreeWidgetItem([s.name, status_text(s), step, loss, Path(s.model).name,
                                    Path(s.data).name, s.settings, ago(s.updated)])
            item.setData(0, Qt.ItemDataRole.UserRole, str(s.path))
            item.setToolTip(0, str(s.path))
            item.setForeground(1, QBrush(QColor(STATUS_COLORS.get(s.status, "#6b7280"))))
            for col in (2, 3):
                item.setTextAlignment(col, Qt.AlignmentFlag.AlignRight |
                                      Qt.AlignmentFlag.AlignVCenter)
            self.table.addTopLevelItem(item)
            if str(s.path) == selected:
                item.setSelected(True)
                self.table.setCurrentItem(item)
        self.empty.setVisible(not summaries)
        self._selection_changed()

    # ---- selection and actions ---------------------------------------------------------------
    def selected_paths(self) -> list[str]:
        return [item.data(0, Qt.ItemDataRole.UserRole) for item in self.table.selectedItems()]

    def selected_path(self) -> str | None:
        """The one selected run (None when none or several are selected)."""
        paths = self.selected_paths()
        return paths[0] if len(paths) == 1 else None

    def selected(self) -> RunSummary | None:
        path = self.selected_path()
        return self.summaries.get(path) if path else None

    def select(self, run_dir: Path | str) -> bool:
        """Select the row of ``run_dir``; False when it is not listed (yet)."""
        target = str(Path(run_dir).resolve())
        for i in range(self.table.topLevelItemCount()):
            item = self.table.topLevelItem(i)
            if item.data(0, Qt.ItemDataRole.UserRole) == target:
                self.table.setCurrentItem(item)
                item.setSelected(True)
                return True
        return False

    def _selection_changed(self) -> None:
        s = self.selected()
        self._update_buttons()
        paths = self.selected_paths()
        self.detail_pages.setCurrentIndex(1 if len(paths) > 1 else 0)
        self.details.setTitle(f"{len(paths)} runs compared" if len(paths) > 1 else "Selected run")
        if len(paths) > 1:
            self._compare(paths)
            return
        if s is None:
            self.details_title.setText("Select a run to see its settings and log.")
            self.config_view.clear()
            self.log_view.clear()
            return
        resumable = f"; resumable from step {s.checkpoint}" if s.resumable else ""
        final = f"; model in {short_path(s.path / 'final')}" if s.has_final else ""
        best = (f"; best checkpoint: step {s.best[0]} (validation loss {s.best[1]:.4f})"
                if s.best else "")
        self.details_title.setText(f"{short_path(s.path)}\n{status_text(s)} at step {s.step}"
                                   f"{resumable}{final}{best}")
        config = read_config_text(s.path).replace(str(Path.home()), "~")  # as paths read here
        if config != self.config_view.toPlainText():
            self.config_view.setPlainText(config)
        self.log_view.setPlainText(text_tail(engine_log(s.path), 30))
        self.log_view.verticalScrollBar().setValue(self.log_view.verticalScrollBar().maximum())

    def _compare(self, paths: list[str]) -> None:
        """Read the chosen runs' curves and configs off the GUI thread, then show them."""
        self.details_title.setText("Loss curves of the chosen runs (dashed: validation) and the "
                                   "settings they differ in.")
        run_task(compare, paths, name="compare-runs", owner=self,
                 done=lambda result: self._show_compare(paths, result),
                 failed=lambda msg: self.details_title.setText(f"Cannot compare: {msg}"))

    def _show_compare(self, paths: list[str], result) -> None:
        if self.selected_paths() == paths:  # not a selection that changed meanwhile
            self.compare_view.show_runs(*result)

    def _update_buttons(self) -> None:
        s = self.selected()
        self.show_button.setEnabled(s is not None)
        self.show_button.setText("Follow live" if s is not None and s.live else
                                 "Show on Train page")
        self.resume_button.setEnabled(s is not None and s.resumable)
        self.open_button.setEnabled(s is not None)
        self.export_button.setEnabled(s is not None and s.has_final and not self._exporting)
        self.ollama_button.setEnabled(s is not None and s.has_final and not self._exporting)

    @Slot()
    def show_selected(self) -> None:
        s = self.selected()
        if s is not None:
            self.ctx.request_run(str(s.path), False)

    @Slot()
    def resume_selected(self) -> None:
        s = self.selected()
        if s is not None and s.resumable:
            self.ctx.request_run(str(s.path), True)

    @Slot()
    def open_selected(self) -> None:
        s = self.selected()
        if s is not None:
            QDesktopServices.openUrl(QUrl.fromLocalFile(str(s.path)))

    @Slot()
    def export_selected(self) -> None:
        s = self.selected()
        if s is None or not s.has_final:
            return
        kind, ok = QInputDialog.getItem(
            self, "Export GGUF", "Type of the weights (bf16, f16: lossless for a bf16 model;\n"
            "q8_0: half the size; q4_0: a quarter, some quality lost):", list(GGUF_EXPORT_TYPES),
            list(GGUF_EXPORT_TYPES).index("bf16"), False)
        if ok:
            self.export_run(str(s.path / "final"), kind)

    def export_run(self, final_dir: str, kind: str) -> None:
        """Export ``final_dir`` as GGUF off the GUI thread; the result shows in the details."""
        self._exporting = True
        self._update_buttons()
        self.export_status.setText(f"Exporting {short_path(final_dir)} as {kind} GGUF…")
        self.export_status.show()
        run_task(export_run_gguf, final_dir, kind, name="export-gguf", owner=self,
                 done=lambda text: self._export_finished(text),
                 failed=lambda msg: self._export_finished(f"Export failed: {msg}"))

    def _export_finished(self, text: str) -> None:
        self._exporting = False
        self.export_status.setText(text)
        self._update_buttons()

    @Slot()
    def send_selected_to_ollama(self) -> None:
        s = self.selected()
        modelfile = newest_export(s.path) if s is not None else None
        if modelfile is None:
            self.export_status.setText("Export GGUF first: Ollama is given the GGUF file and "
                                       "the Modelfile written next to it.")
            self.export_status.show()
            return
        name, ok = QInputDialog.getText(self, "Send to Ollama", "Name of the Ollama model:",
                                        text=ollama_model_name(modelfile))
        if ok and name.strip():
            self.send_to_ollama(str(modelfile), name.strip())

    def send_to_ollama(self, modelfile: str, name: str) -> None:
        """``ollama create`` on an export off the GUI thread; the result or the how-to shows
        in the details."""
        self._exporting = True
        self._update_buttons()
        self.export_status.setText(f"Sending {short_path(modelfile)} to Ollama as {name}…")
        self.export_status.show()
        run_task(send_export_to_ollama, modelfile, name, name="ollama-create", owner=self,
                 done=self._export_finished,
                 failed=lambda msg: self._export_finished(f"Send to Ollama failed: {msg}"))

    @Slot()
    def choose_run_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a run folder", str(Path.home()))
        if path:
            self.add_run_folder(path)

    def add_run_folder(self, path: str) -> bool:
        """List the run folder ``path`` from now on; False if it holds no run."""
        if not is_run_dir(Path(path)):
            self.details_title.setText(f"{short_path(path)} is not a run folder (it has no "
                                       f"events.jsonl).")
            return False
        self.ctx.settings.add_extra_run(str(Path(path).resolve()))
        self.refresh()
        return True

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.refresh()
