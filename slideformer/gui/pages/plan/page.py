"""The Plan page: will the run fit, where every byte goes, how to make it fit, and how fast it runs.

The page turns its inputs into a run config and asks the planner (:func:`slideformer.engine.plan.plan_run`,
which reads only the model's config.json; it runs in a process of its own, see
:mod:`plan_worker`). Everything shown is the planner's answer, written out: the stacked bars per
tier (:mod:`plan_rows`, :mod:`plan_bars`), the verdict, the fixes (a click applies a fix's
settings to the inputs), the largest batches and the predicted speed.

Recomputing: every edit restarts a short timer; when it fires the page asks the planner, one
request at a time. An answer for inputs that changed meanwhile is dropped and the latest inputs
are planned instead, so the page always ends on the plan of what it shows. Until it does, the
plan on screen is greyed out under a "Recomputing" line: it answers other inputs.

"Use this plan" puts the plan's settings into the next run (AppContext.use_plan) and shows the
Train page, which then names the plan next to Start.
"""
from __future__ import annotations

import html
import math
from pathlib import Path

from PySide6.QtCore import QCoreApplication, Qt, QTimer
from PySide6.QtWidgets import (QBoxLayout, QDoubleSpinBox, QFileDialog, QFrame, QGroupBox,
                               QHBoxLayout, QLabel, QPushButton, QScrollArea, QVBoxLayout,
                               QWidget)

from slideformer.engine.api import Fix, Plan
from slideformer.gui.context import AppContext
from slideformer.gui.models.fit import VERDICT_TITLES, fits_html, numbered_fits
from slideformer.gui.models.formatting import human_count, resource_title
from slideformer.gui.widgets.bars import STATE_COLORS, StackedBars, legend
from slideformer.gui.pages.plan.fixes import FixList
from slideformer.gui.pages.plan.inputs import Machine, PlanInputs, detect_machine
from slideformer.gui.pages.plan.rows import busy_rows, memory_rows
from slideformer.gui.workers.planner import PlanReplies, shared_planner
from slideformer.gui.workers.thread import run_task
from slideformer.gui.widgets.common import page_header, set_state

WIDE_PX = 1080
"""From this page width on, the inputs are a column left of the results; below it, above them."""
SIDE_BY_SIDE_PX = 780
"""Above the results, the two input boxes stand side by side from this page width on."""
INPUTS_PX = 380
DEBOUNCE_MS = 150
"""An input changed: wait this long for the next change before planning again."""
NO_MODEL = ("No model chosen yet. Choose one on the Model page: the plan needs only its "
            "config.json, nothing is loaded.")


def duration(seconds: float) -> str:
    """3725 -> "1 h 2 min"; days for long runs."""
    s = int(round(seconds))
    d, h, m = s // 86400, s % 86400 // 3600, s % 3600 // 60
    if d:
        return f"{d} d {h} h"
    if h:
        return f"{h} h {m} min"
    return f"{m} min {s % 60} s" if m else f"{s} s"


class PlanPage(QWidget):
    """Budgets and run shape in, the planner's verdict, bars, fixes and speed out."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.machine: Machine | None = None
        self.plan: Plan | None = None
        """The plan on screen."""
        self.plans_shown = 0
        self._version = 0
        """Bumped on every edit; an answer for an older version is stale."""
        self._shown_version = -1
        self._asked = -1
        """The version the planner is working on."""
        self._busy = False
        """A request is out with the planner."""
        self._verdict_style = ""
        self._detect_error = ""

        self._build_inputs(ctx)
        self._build_status()
        self.results = self._build_results()
        self.results.hide()
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Plan", "Will the run fit, where every byte goes and how fast "
                                          "it will train: predicted from the model's config "
                                          "before anything loads."))
        lay.addWidget(self._build_body(), 1)
        self._connect(ctx)

    # ---- layout -----------------------------------------------------------------------------
    def _build_inputs(self, ctx: AppContext) -> None:
        """The inputs, each edit restarting the debounce timer that plans them."""
        self.debounce = QTimer(self)
        self.debounce.setSingleShot(True)
        self.debounce.setInterval(DEBOUNCE_MS)
        self.debounce.timeout.connect(self._start)
        self.inputs = PlanInputs()
        self.inputs.changed.connect(self._edited)
        self.inputs.find_max_batch.connect(self.use_max_batch)
        self.inputs.target.setCurrentIndex(self.inputs.target.findData(ctx.target))
        self.inputs.target.currentIndexChanged.connect(self._target_changed)
        self.inputs.set_settings({"data.max_seq_len": ctx.data_config.max_seq_len})

    def _build_status(self) -> None:
        """The status line and the "Recomputing" line above the results."""
        self.status = QLabel(NO_MODEL)
        self.status.setObjectName("status")
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        set_state(self.status, "info")
        self.recomputing = QLabel("Recomputing for the changed settings… (the plan below is for "
                                  "the previous ones)")
        self.recomputing.setObjectName("status")
        self.recomputing.setWordWrap(True)
        set_state(self.recomputing, "busy")
        self.recomputing.hide()

    def _build_body(self) -> QScrollArea:
        """The inputs and the results column in one scroll area (resizeEvent arranges them for
        the page width)."""
        column = QWidget()
        col = QVBoxLayout(column)
        col.setContentsMargins(0, 0, 0, 0)
        col.addWidget(self.status)
        col.addWidget(self.recomputing)
        col.addWidget(self.results)
        col.addStretch(1)
        content = QWidget()
        self._body = QBoxLayout(QBoxLayout.Direction.TopToBottom, content)
        self._body.setContentsMargins(0, 0, 6, 0)
        self._body.addWidget(self.inputs, 0, Qt.AlignmentFlag.AlignTop)
        self._body.addWidget(column, 1)
        self._layout = ""
        scroll = QScrollArea()
        scroll.setWidget(content)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        content.setObjectName("planContent")  # the window's background shows through
        scroll.setStyleSheet("QScrollArea, QWidget#planContent { background: transparent; }")
        return scroll

    def _connect(self, ctx: AppContext) -> None:
        """Follow the app's model, target and data; wire the planner's replies; detect the
        machine off the GUI thread."""
        ctx.model_changed.connect(self._model_changed)
        ctx.target_changed.connect(
            lambda key: self.inputs.target.setCurrentIndex(self.inputs.target.findData(key)))
        ctx.data_changed.connect(self._data_changed)
        self.planner = shared_planner()
        # Owned by the app, so a request still out when the page goes never deletes it in the
        # requests thread; the page's bound methods are disconnected when the page goes.
        self._replies = PlanReplies(QCoreApplication.instance())
        self._replies.planned.connect(self._planned)  # bound methods: gone with the page
        self._replies.failed.connect(self._not_planned)
        run_task(detect_machine, name="plan-machine", owner=self, done=self.set_machine,
                 failed=self._not_detected)

    def _build_results(self) -> QWidget:
        self.verdict = QLabel("")
        self.verdict.setObjectName("status")
        self.verdict.setWordWrap(True)
        self.verdict.setTextFormat(Qt.TextFormat.RichText)
        self.notes = QLabel("")
        self.notes.setObjectName("hint")
        self.notes.setWordWrap(True)
        self.fixes = FixList(self.inputs.can_apply)
        self.fixes.chosen.connect(self.apply_fix)
        self.shape = QLabel("")
        self.shape.setWordWrap(True)
        self.methods = QLabel("")
        self.methods.setTextFormat(Qt.TextFormat.RichText)
        self.methods.setWordWrap(True)
        self.methods.setToolTip("The same settings under each training method (the Method "
                                "input chooses the one planned above)")
        self.method_fits = ()
        """The verdicts of :attr:`methods` (for the plan on screen once it settles)."""
        self._methods_asked: int | None = None
        """The version whose methods are being planned, or None."""
        self.use_button = QPushButton("Use this plan")
        self.use_button.setObjectName("primary")
        self.use_button.setToolTip("Train with these settings: the Train page takes the plan's "
                                   "sequence length, batch, precision and budgets")
        self.use_button.clicked.connect(self.use_plan)
        use_row = QHBoxLayout()
        use_row.addWidget(self.use_button)
        use_row.addStretch(1)
        verdict_box = QGroupBox("Verdict")
        v = QVBoxLayout(verdict_box)
        for w in (self.verdict, self.methods, self.notes, self.fixes, self.shape):
            v.addWidget(w)
        v.addLayout(use_row)

        self.memory = StackedBars()
        hint = QLabel("Each bar is what the tier holds at its peak; the dashed line is its "
                      "budget. Hover a segment for what it is and how its size follows.")
        hint.setObjectName("hint")
        hint.setWordWrap(True)
        memory_box = QGroupBox("Memory")
        m = QVBoxLayout(memory_box)
        m.addWidget(self.memory)
        m.addWidget(legend())
        m.addWidget(hint)

        self.speed = QLabel("")
        self.speed.setTextFormat(Qt.TextFormat.RichText)
        self.speed.setWordWrap(True)
        self.tokens = QDoubleSpinBox(decimals=1, minimum=0.1, maximum=1e7, suffix=" M tokens")
        self.tokens.setValue(100.0)
        self.tokens.valueChanged.connect(self._show_eta)
        self.eta = QLabel("")
        eta_row = QHBoxLayout()
        eta_row.addWidget(QLabel("Time to train on"))
        eta_row.addWidget(self.tokens)
        eta_row.addWidget(self.eta, 1)
        self.busy = StackedBars(row_height=26, bar_height=16, title_width=150, shared_scale=True)
        self.speed_note = QLabel("")
        self.speed_note.setObjectName("hint")
        self.speed_note.setWordWrap(True)
        speed_box = QGroupBox("Speed")
        s = QVBoxLayout(speed_box)
        s.addWidget(self.speed)
        s.addLayout(eta_row)
        s.addWidget(QLabel("Work per step on each resource; the busiest bounds the step:"))
        s.addWidget(self.busy)
        s.addWidget(self.speed_note)
        self.speeds = QLabel("")
        self.speeds.setObjectName("hint")
        self.speeds.setWordWrap(True)
        s.addWidget(self.speeds)

        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(0, 0, 0, 0)
        for w in (verdict_box, memory_box, speed_box):
            lay.addWidget(w)
        return box

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        width = self.width()
        layout = "column" if width >= WIDE_PX else "row" if width >= SIDE_BY_SIDE_PX else "stack"
        if layout != self._layout:
            self._layout = layout
            wide = layout == "column"
            self._body.setDirection(QBoxLayout.Direction.LeftToRight if wide
                                    else QBoxLayout.Direction.TopToBottom)
            self.inputs.set_stacked(layout != "row")
            self.inputs.setMaximumWidth(INPUTS_PX if wide else 16777215)

    # ---- inputs -----------------------------------------------------------------------------
    def set_machine(self, machine: Machine) -> None:
        """Plan for ``machine`` (what :func:`detect_machine` found), from its budgets."""
        self.machine = machine
        self.inputs.set_machine(machine)
        profile = machine.profile
        measured = "measured on this machine" if profile.measured else (
            "not measured here: `slideformer bench --hardware` measures this machine")
        self.speeds.setText(f"Speeds of: {profile.name}, {measured}.")
        self.speeds.setToolTip("\n".join(profile.figure_lines() + list(profile.notes)))
        self._edited()
        self.debounce.stop()
        self._start()

    def _not_detected(self, message: str) -> None:
        self._detect_error = message
        self._show_status("error", message)

    def _target_changed(self) -> None:
        """Plan for another machine: find what it has, then plan again from its budgets."""
        self.ctx.set_target(self.inputs.target.currentData())
        self._version += 1
        self._mark_stale()
        run_task(detect_machine, self.inputs.target.currentData(), name="plan-machine", owner=self,
                 done=self.set_machine, failed=self._not_detected)

    def _model_changed(self, path: str) -> None:
        self._version += 1
        self._mark_stale()
        self.debounce.stop()
        self._start()

    def _data_changed(self) -> None:
        """The draft's sequence length is shared with the Data and Train pages."""
        seq = self.ctx.data_config.max_seq_len
        if seq != self.inputs.seq_len.value():
            self.inputs.apply({"data.max_seq_len": seq})

    def _edited(self) -> None:
        self._version += 1
        self._mark_stale()
        self.debounce.start()

    def _mark_stale(self) -> None:
        """The plan on screen no longer answers the inputs: grey it out and say so."""
        if self.plan is not None and self.results.isVisible():
            self.results.setEnabled(False)
            self.recomputing.show()

    def use_plan(self) -> None:
        """Train with the plan on screen: its settings go into the next run's draft."""
        if self.plan is None or not self.settled():
            return
        settings = self.inputs.settings()
        if self.machine is not None and self.machine.profile.preset:
            # Budgets of a GPU this machine does not have would only mislead its run.
            settings = {k: v for k, v in settings.items() if not k.startswith("budget.")}
        self.ctx.use_plan(self.plan, settings)

    def use_max_batch(self) -> None:
        """Set the micro-batch to the largest the plan says fits."""
        if self.plan is not None and self.plan.max_micro_batch:
            self.inputs.apply({"train.micro_batch": self.plan.max_micro_batch})

    def apply_fix(self, fix: Fix) -> None:
        """Put the fix's settings into the inputs and plan at once (a fix that needs an NVMe
        folder asks for one first)."""
        settings = dict(fix.settings)
        folder = settings.get("budget.nvme_dir")
        if folder is not None and not Path(folder).is_dir():
            folder = QFileDialog.getExistingDirectory(self, "Folder on the NVMe disk")
            if not folder:
                return
            settings["budget.nvme_dir"] = folder
        self.inputs.apply(settings)
        self.debounce.stop()
        self._start()

    # ---- planning ---------------------------------------------------------------------------
    def _start(self) -> None:
        if self.machine is None:
            self._show_status(*(("error", self._detect_error) if self._detect_error
                                else ("busy", "Detecting this machine…")))
            return
        if self.ctx.model_path is None:
            self._show_status("info", NO_MODEL)
            return
        if self._busy:
            return  # planned again when the running one answers
        if self.plan is None:
            self._show_status("busy", "Planning…")
        self._asked, self._busy = self._version, True
        self.planner.start()  # once a model is chosen: the process holds the engine (~300 MB)
        self.planner.ask(self._replies, self.ctx.model_path, self.inputs.settings(),
                         self.machine.profile)

    def _planned(self, plan: Plan) -> None:
        self._answered(plan, None)

    def _not_planned(self, message: str) -> None:
        self._answered(None, message)

    def _answered(self, plan: Plan | None, message: str | None) -> None:
        self._busy, version = False, self._asked
        if version != self._version:  # the inputs changed meanwhile: plan them instead
            if not self.debounce.isActive():
                self._start()
            return
        self._shown_version = version
        if plan is None:
            self._show_status("error", message)
            return
        self._show_plan(plan)

    def settled(self) -> bool:
        """The page shows the planner's answer (plan or error) for its current inputs."""
        return self._shown_version == self._version and not self._busy

    def _show_status(self, state: str, text: str) -> None:
        self.status.setText(text)
        set_state(self.status, state)
        self.status.show()
        self.recomputing.hide()
        self.results.hide()

    # ---- showing a plan ---------------------------------------------------------------------
    def _show_plan(self, plan: Plan) -> None:
        self.plan = plan
        self.status.hide()
        self.recomputing.hide()
        self.results.setEnabled(True)
        self.results.show()
        self._show_verdict(plan)
        self.memory.set_rows(memory_rows(plan))
        self.busy.set_rows(busy_rows(plan))
        sp = plan.speed
        self.speed.setText(f'<span style="font-size:15pt; font-weight:600">{sp.tokens_per_s:,.0f}'
                           f'</span> tokens/s &nbsp;&middot;&nbsp; <b>{sp.step_time:.2f} s</b> per '
                           f'step of {plan.tokens_per_step:,} tokens &nbsp;&middot;&nbsp; bound by '
                           f'<b>{resource_title(sp.bound, plan.device)}</b>'
                           + (f' &nbsp;&middot;&nbsp; {clipped:,.0f} when a step clips'
                              if (clipped := plan.clipped_tokens_per_s) else ''))
        notes = [sp.note[:1].upper() + sp.note[1:] + "."] if sp.note else []
        if plan.verdict == "does not fit":
            notes.insert(0, "The speed of these settings if they fitted.")
        self.speed_note.setText(" ".join(notes))
        self.speed_note.setVisible(bool(notes))
        self._show_eta()
        mb = plan.max_micro_batch
        self.inputs.max_button.setEnabled(mb > 0 and mb != self.inputs.micro_batch.value())
        self.plans_shown += 1
        self._ask_methods()

    # ---- every method -----------------------------------------------------------------------
    def _ask_methods(self) -> None:
        """Plan the settings on screen under each method (one request at a time)."""
        self.methods.setEnabled(False)
        if self._methods_asked is not None or not self.settled():
            return  # asked again when the running one answers
        self._methods_asked = version = self._version
        settings = {k: v for k, v in self.inputs.settings().items() if k != "train.method"}
        run_task(numbered_fits, version, self.planner.plan, self.ctx.model_path, settings,
                 self.machine.profile, name="plan-methods", owner=self, done=self._methods_answered,
                 failed=self._methods_failed)

    def _methods_failed(self, _message: str) -> None:
        self._methods_asked = None  # the main plan shows what is wrong with the inputs

    def _methods_answered(self, answer: tuple) -> None:
        version, fits, _message = answer  # no line rather than a wrong one
        self._methods_asked = None
        if version != self._version:
            if self.settled():
                self._ask_methods()
            return
        self.method_fits = fits
        self.methods.setText(f"Each method: {fits_html(fits, STATE_COLORS)}" if fits else "")
        self.methods.setEnabled(True)

    def _show_verdict(self, plan: Plan) -> None:
        title = VERDICT_TITLES.get(plan.verdict, plan.verdict)
        self.verdict.setText(f'<span style="font-size:14pt; font-weight:600">{title}</span>'
                             f'<br>{html.escape(plan.reason[:1].upper() + plan.reason[1:])}.')
        if self._verdict_style != plan.verdict:  # restyling costs milliseconds: only on change
            self._verdict_style = plan.verdict
            self.verdict.setObjectName("notice" if plan.verdict == "tight" else "status")
            set_state(self.verdict, "ok" if plan.verdict == "fits" else "error")
        self.notes.setText("\n".join(n[:1].upper() + n[1:] + "." for n in plan.notes))
        self.notes.setVisible(bool(plan.notes))
        self.fixes.set_fixes(plan.fixes)
        s = plan.exec_shape
        name = Path(self.ctx.model_path or "").name
        batches = (f"Largest micro-batch that fits: <b>{plan.max_micro_batch}</b> (with "
                   f"accumulation {s.n_micro}); largest global batch: "
                   f"<b>{plan.max_global_batch}</b> sequences." if plan.max_micro_batch else
                   "No micro-batch fits these budgets.")
        # The CPU backend's "device" is host RAM: its slots and checkpoints are not on a GPU.
        device = "on the GPU" if plan.device == "cuda" else "in host RAM"
        ckpt = device if s.checkpoints == "gpu" else "in host RAM" + (
            f" (the top {s.gpu_checkpoints} layers' on the GPU)" if s.gpu_checkpoints else "")
        self.shape.setText(
            f"{batches}<br><span style='color:gray'>{html.escape(name)} ({plan.model_type}, "
            f"{human_count(plan.total_params)} parameters{_active(plan)}) on {plan.device}: "
            f"{s.slots} layer slots "
            f"{device}, checkpoints {ckpt}, "
            f"{_device_items(s, plan.method)}"
            f"{plan.compute_dtype} compute, {plan.moments_dtype} moments.</span>")

    def fix_buttons(self) -> list[QPushButton]:
        """The fix buttons on screen, in the plan's order."""
        return self.fixes.buttons()

    def _show_eta(self) -> None:
        plan = self.plan
        if plan is None or not plan.tokens_per_step:
            self.eta.setText("")
            return
        steps = math.ceil(self.tokens.value() * 1e6 / plan.tokens_per_step)
        clipped = plan.clipped_tokens_per_s
        slow = (f", {duration(steps * plan.tokens_per_step / clipped)} if every step clips"
                if clipped else "")
        self.eta.setText(f"<b>{duration(steps * plan.speed.step_time)}</b> "
                         f"({steps:,} steps{slow})")


def _device_items(shape, method: str = "full") -> str:
    """Which items the GPU updates itself (the rest go through the CPU optimizer); a frozen
    base's adapters are all updated on the GPU (plan.frozen)."""
    if method in ("lora", "qlora"):
        return "adapters updated on the GPU, "
    if not shape.device_update and not shape.device_layers:
        return "all updates on the CPU, "
    layers = f" and {shape.device_layers} layers" if shape.device_layers else ""
    return f"embedding, head{layers} updated on the GPU, "


def _active(plan) -> str:
    """", 3.3B active" for a mixture of experts, else nothing."""
    if plan.active_params == plan.total_params:
        return ""
    return f", {human_count(plan.active_params)} active"
