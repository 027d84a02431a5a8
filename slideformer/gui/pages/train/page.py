"""The Train page: settings and presets, start / pause / resume / stop-and-save, and the run's
dashboard (:mod:`train_dashboard`).

The run is an engine process owned by an :class:`~slideformer.gui.workers.run.EngineBridge`,
whose events the page hands to the dashboard; the page keeps the run's phase and what the
buttons may do in it. The page can also show a run it did not start (the Runs page's "Follow"),
or resume a stopped or crashed one from its last checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QUrl, Slot
from PySide6.QtGui import QDesktopServices
from PySide6.QtWidgets import (QGroupBox, QHBoxLayout, QLabel, QMessageBox, QPushButton,
                               QSplitter, QVBoxLayout, QWidget)

from slideformer.engine.api import (RunClient, RunState, StepMetrics, UserError, load_config, override,
                                    suggest_settings)
from slideformer.gui.context import AppContext
from slideformer.gui.workers.run import EngineBridge, RunEnd, launch_argv
from slideformer.gui.models.formatting import resource_title, short_path
from slideformer.gui.models.presets import Preset
from slideformer.gui.models.runs import CONFIG_FILE, latest_checkpoint
from slideformer.gui.theme import PLOT_COLORS
from slideformer.gui.pages.train.dashboard import Dashboard
from slideformer.gui.pages.train.settings import CommandDialog, RunSettings, write_config
from slideformer.gui.widgets.common import ColumnScroll, page_header
from slideformer.gui.workers.thread import run_task

ACTIVE = ("starting", "setup", "running", "pausing", "paused", "resuming", "stopping", "saving")
STATE_TEXT = {
    "starting": "Starting the engine…",
    "setup": "Setting up: loading the model and preparing the data…",
    "running": "Training.",
    "pausing": "Pausing after the current step…",
    "paused": "Paused. Resume continues exactly where it stopped.",
    "resuming": "Resuming…",
    "stopping": "Stopping after the current step, then saving…",
    "saving": "Saving: writing the checkpoint and the final model…",
}


class TrainPage(QWidget):
    """Run settings on the left, the live run on the right."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.bridge: EngineBridge | None = None
        self.run_dir: Path | None = None
        self.phase = "idle"
        self.end: RunEnd | None = None
        self.plan = None
        """The Plan page's plan the settings came from ("Use this plan"), or None."""
        self.plan_settings: dict = {}
        self.run_plan = None
        """The plan the run on screen was started with (its speed is compared with it)."""
        self._measured_tps: float | None = None
        self.dashboard = Dashboard()

        self.settings = RunSettings()
        self.settings.changed.connect(self._settings_changed)
        self.settings.preset_applied.connect(self._preset_applied)
        self.settings.suggest_requested.connect(self.suggest)
        self.inputs = QLabel("")
        self.inputs.setObjectName("hint")
        self.inputs.setWordWrap(True)
        self.command_button = QPushButton("Show terminal command")
        self.command_button.clicked.connect(self.show_command)
        settings_box = QGroupBox("Settings")
        sl = QVBoxLayout(settings_box)
        sl.addWidget(self.inputs)
        sl.addWidget(self.settings)
        sl.addWidget(self.command_button)
        sl.addStretch(1)
        scroll = ColumnScroll(settings_box)  # scrolls vertically, never clips sideways

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(scroll)
        splitter.addWidget(self._build_run_side())
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([scroll.minimumSizeHint().width(), 1000])
        splitter.setChildrenCollapsible(False)
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Train", "Fine-tune the chosen model on the chosen data. The "
                                           "run is an engine process of its own: the app stays "
                                           "responsive, and the run survives the app."))
        lay.addWidget(splitter, 1)

        ctx.model_changed.connect(self._inputs_changed)
        ctx.model_changed.connect(self._first_suggestion)
        ctx.data_changed.connect(self._inputs_changed)
        ctx.theme_changed.connect(lambda name: self.dashboard.set_colors(*PLOT_COLORS[name]))
        ctx.run_requested.connect(self.open_run)
        ctx.plan_used.connect(self.use_plan)
        self.dashboard.set_colors(*PLOT_COLORS[ctx.settings.theme()])
        self._auto_output = ""
        """The run folder the page proposed; a folder the user typed is left alone."""
        self._new_output()
        self._inputs_changed()
        self._show_status("info", "Choose a model and a dataset, pick a preset, then Start.")

    def _build_run_side(self) -> QWidget:
        self.start_button = QPushButton("Start")
        self.start_button.setObjectName("primary")
        self.start_button.clicked.connect(self.start)
        self.pause_button = QPushButton("Pause")
        self.pause_button.clicked.connect(self._pause_clicked)
        self.stop_button = QPushButton("Stop and save")
        self.stop_button.setToolTip("Stop after the current step, then write a checkpoint and "
                                    "the final model")
        self.stop_button.clicked.connect(self.stop_and_save)
        self.detach_button = QPushButton("Stop following")
        self.detach_button.setToolTip("Let the run carry on without the app showing it")
        self.detach_button.clicked.connect(self.detach)
        self.resume_button = QPushButton("Resume run")
        self.resume_button.setToolTip("Continue from the newest checkpoint")
        self.resume_button.clicked.connect(lambda: self.resume_run(self.run_dir))
        self.open_button = QPushButton("Open folder")
        self.open_button.setToolTip("Open the run folder in the file manager")
        self.open_button.clicked.connect(
            lambda: QDesktopServices.openUrl(QUrl.fromLocalFile(str(self.run_dir))))
        controls = QHBoxLayout()
        for w in (self.start_button, self.pause_button, self.stop_button, self.detach_button,
                  self.resume_button):
            controls.addWidget(w)
        controls.addStretch(1)
        controls.addWidget(self.open_button)
        self.plan_label = QLabel("No plan used: the Plan page's \"Use this plan\" sets the run "
                                 "from a plan and shows its prediction here.")
        self.plan_label.setObjectName("hint")
        self.plan_label.setWordWrap(True)
        self.plan_label.setTextFormat(Qt.TextFormat.PlainText)
        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(4, 0, 0, 0)
        lay.addLayout(controls)
        lay.addWidget(self.plan_label)
        lay.addWidget(self.dashboard, 1)
        return box

    # ---- inputs and settings ---------------------------------------------------------------
    def fresh_run_dir(self) -> Path:
        """A new run folder under the app's runs folder, named after the model and the time."""
        name = Path(self.ctx.model_path).name if self.ctx.model_path else "run"
        base = self.ctx.runs_dir / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
        path, n = base, 1
        while path.exists():  # two runs started within a second
            n += 1
            path = base.with_name(f"{base.name}-{n}")
        return path

    def _new_output(self) -> None:
        self._auto_output = str(self.fresh_run_dir())
        self.settings.output.setText(self._auto_output)

    def run_config(self):
        """The RunConfig that Start runs: the form, the Model page's folder, the Data page's
        settings (the sequence length is shared between the two pages)."""
        cfg = self.settings.config()
        run_dir = Path(cfg.output.run_dir or self.fresh_run_dir()).expanduser()
        if not run_dir.is_absolute():
            run_dir = self.ctx.runs_dir / run_dir
        return replace(cfg, model=replace(cfg.model, path=self.ctx.model_path or ""),
                       data=replace(self.ctx.data_config, max_seq_len=cfg.data.max_seq_len),
                       output=replace(cfg.output, run_dir=str(run_dir)))

    def _settings_changed(self) -> None:
        """The sequence length is shared with the Data page."""
        self.ctx.set_data_config(replace(self.ctx.data_config,
                                         max_seq_len=self.settings.seq_len.value()))
        self._show_plan()

    @Slot(object, dict)
    def use_plan(self, plan, settings: dict) -> None:
        """Take the run's shape, precision and budgets from a plan, and show its prediction."""
        self.plan, self.plan_settings = plan, dict(settings)
        self.settings.show_config(override(self.settings.config(), settings))
        self._settings_changed()

    def plan_matches(self) -> bool:
        """Whether the settings are still those the plan was made for."""
        cfg = self.settings.config()
        return self.plan is not None and override(cfg, self.plan_settings) == cfg

    def _show_plan(self) -> None:
        """The plan's verdict and predicted speed next to Start; measured speed once running."""
        plan = self.plan
        if plan is None:
            return
        predicted = plan.speed.tokens_per_s
        bound = resource_title(plan.speed.bound, plan.device)  # "CPU compute" on the CPU backend
        text = (f"Plan: {plan.verdict} on {plan.hardware.name}; predicted {predicted:,.0f} "
                f"tokens/s ({plan.speed.step_time:.2f} s per step, bound by {bound})")
        if not self.plan_matches():
            text += ". The settings changed since: plan them again on the Plan page."
        elif self._measured_tps is not None and self.run_plan is plan:
            text += (f"; measured {self._measured_tps:,.0f} tokens/s "
                     f"({self._measured_tps / predicted:.0%} of the prediction)")
        self.plan_label.setText(text + ".")

    @Slot()
    def suggest(self, first: bool = False) -> None:
        """Ask the planner for first settings for the chosen model and target machine (off
        the GUI thread); they fill the form as a preset (``first``: only if the form is still
        untouched when they arrive)."""
        if not self.ctx.model_path:
            self._show_status("error", "Choose a model first (Model page).")
            return
        model, target = self.ctx.model_path, self.ctx.target
        self.settings.suggest_button.setEnabled(False)
        self._show_status("busy", f"Choosing settings for {Path(model).name}…")
        run_task(suggest_settings, model, target, name="suggest", owner=self,
                 done=lambda s: self._suggested(model, s, first),
                 failed=lambda msg: self._suggest_failed(msg))

    def _suggested(self, model: str, suggestion, first: bool) -> None:
        self.settings.suggest_button.setEnabled(True)
        if first and not (self.settings.is_untouched() and model == self.ctx.model_path):
            self._show_status("info", "Choose a model and a dataset, pick a preset, then Start.")
            return
        note = "Suggested: " + "; ".join(suggestion.reasons) + f". Plan: {suggestion.verdict}."
        self.settings.show_suggestion(Preset(f"Suggested for {Path(model).name}", note,
                                             suggestion.tables()))
        self._show_status("info", "Settings suggested for this model and machine: check them, "
                                  "then Start.")

    def _suggest_failed(self, message: str) -> None:
        self.settings.suggest_button.setEnabled(True)
        self._show_status("error", f"No suggestion: {message}")

    def _first_suggestion(self, *_args) -> None:
        """The first-run path: a model chosen while the form is untouched gets suggested
        settings at once."""
        if self.ctx.model_path and self.settings.is_untouched() and self.run_dir is None:
            self.suggest(first=True)

    def _preset_applied(self, preset) -> None:
        """A preset's [data] keys go to the Data page's settings."""
        self.ctx.set_data_config(replace(self.ctx.data_config, **preset.values.get("data", {})))

    def _inputs_changed(self, *_args) -> None:
        model = Path(self.ctx.model_path).name if self.ctx.model_path else "none chosen"
        data = Path(self.ctx.data_config.train).name if self.ctx.data_config.train else \
            "none chosen"
        self.inputs.setText(f"Model: {model}\nData: {data}")
        if self.settings.seq_len.value() != self.ctx.data_config.max_seq_len:
            self.settings.show_config(replace(self.settings.base, data=replace(
                self.settings.base.data, max_seq_len=self.ctx.data_config.max_seq_len)))
        if self.settings.output.text() == self._auto_output:
            self._new_output()
        self._update_buttons()

    def _ready(self) -> str | None:
        """Why Start cannot run now, or None."""
        if not self.ctx.model_path:
            return "Choose a model first (Model page)."
        if (self.ctx.model_report or {}).get("config_only"):
            return ("The model folder has no weights yet, so it can be planned but not "
                    "trained: download its *.safetensors into it, then choose it again.")
        if not self.ctx.data_config.train:
            return "Choose a dataset first (Data page)."
        return None

    @Slot()
    def show_command(self) -> CommandDialog | None:
        why = self._ready()
        if why:
            self._show_status("error", why)
            return None
        cfg = self.run_config()
        problem = self._unusable(Path(cfg.output.run_dir))
        if problem:
            self._show_status("error", problem)
            return None
        path = write_config(cfg, Path(cfg.output.run_dir) / CONFIG_FILE)
        dialog = CommandDialog(path, path.read_text(encoding="utf-8"), parent=self)
        dialog.setAttribute(Qt.WidgetAttribute.WA_DeleteOnClose)
        dialog.open()
        return dialog

    # ---- starting and following runs -------------------------------------------------------
    @staticmethod
    def _unusable(run_dir: Path) -> str | None:
        """Why ``run_dir`` cannot take a new run (it holds more than its config file)."""
        if run_dir.is_file() or (run_dir.is_dir() and
                                 {p.name for p in run_dir.iterdir()} - {CONFIG_FILE}):
            return (f"{short_path(run_dir)} already holds a run. Choose another run folder, or "
                    f"resume that run from the Runs page.")
        return None

    @Slot()
    def start(self) -> None:
        """Write the run's config.toml into its folder and start the engine on it."""
        why = self._ready()
        if why:
            self._show_status("error", why)
            return
        cfg = self.run_config()
        run_dir = Path(cfg.output.run_dir)
        problem = self._unusable(run_dir)
        if problem:
            self._show_status("error", problem)
            return
        config_file = write_config(cfg, run_dir / CONFIG_FILE)
        self._launch(run_dir, launch_argv(config_file, resume=False))
        self.run_plan = self.plan if self.plan_matches() else None
        self._new_output()

    def resume_run(self, run_dir: Path | str) -> None:
        """Continue a stopped or crashed run from its newest checkpoint."""
        run_dir = Path(run_dir)
        owner = RunClient(run_dir).alive()
        if owner is not None:  # one owner per folder: a second engine would interleave it
            self._show_status("error", f"{short_path(run_dir)} is being trained by process "
                                       f"{owner} right now: follow it from the Runs page "
                                       f"instead, or stop it first.")
            return
        if latest_checkpoint(run_dir) is None:
            self._show_status("error", f"{short_path(run_dir)} has no checkpoint to resume "
                                       f"from.")
            return
        self._launch(run_dir, launch_argv(run_dir / CONFIG_FILE, resume=True))

    def follow_run(self, run_dir: Path | str) -> None:
        """Show a run some other process runs (a terminal, an earlier session of the app)."""
        self._launch(Path(run_dir), None)

    @Slot(str, bool)
    def open_run(self, run_dir: str, resume: bool) -> None:
        """Show ``run_dir`` (a request from another page): resume it or follow it."""
        if self.bridge is not None:
            if self.bridge.owned:
                self._show_status("error", "A run is in progress: stop it before opening "
                                           "another one.")
                return
            self._let_go()
        if resume:
            self.resume_run(run_dir)
        else:
            self.follow_run(run_dir)

    def _show_run_config(self, run_dir: Path) -> None:
        """The settings, model and data of the run on screen (one the app did not start, too)."""
        try:
            cfg = load_config(run_dir / CONFIG_FILE)
        except UserError:
            return  # a run folder from before config.toml: its events still show
        self.settings.show_config(cfg)
        self.inputs.setText(f"Model: {Path(cfg.model.path).name}\n"
                            f"Data: {Path(cfg.data.train).name}  (this run's)")

    def _launch(self, run_dir: Path, argv: list[str] | None) -> None:
        self._show_run_config(run_dir)
        self.run_dir = run_dir
        self.end = None
        self._measured_tps = self.run_plan = None
        self.dashboard.reset(run_dir)
        self.bridge = EngineBridge(run_dir, argv, parent=self)
        self.bridge.events.connect(self._on_events)
        self.bridge.ended.connect(self._on_ended)
        self.bridge.finished.connect(self.bridge.deleteLater)
        self._set_phase("starting" if argv is not None else "setup")
        self._show_status("busy", f"{STATE_TEXT['starting']}  {short_path(run_dir)}")
        self.bridge.start()

    # ---- commands --------------------------------------------------------------------------
    @Slot()
    def _pause_clicked(self) -> None:
        if self.phase == "paused":
            self.resume()
        else:
            self.pause()

    def pause(self) -> None:
        if self.bridge is not None and self.phase == "running":
            self.bridge.pause()
            self._set_phase("pausing")

    def resume(self) -> None:
        if self.bridge is not None and self.phase in ("paused", "pausing"):
            self.bridge.resume()
            self._set_phase("resuming")

    def stop_and_save(self) -> None:
        if self.bridge is not None and self.phase in ACTIVE:
            self.bridge.stop_and_save()
            self._set_phase("stopping")

    def abort(self) -> None:
        if self.bridge is not None:
            self.bridge.abort()

    @Slot()
    def detach(self) -> None:
        if self.bridge is not None:
            self.bridge.detach()

    def _let_go(self) -> None:
        """Stop following now (the bridge's thread ends within one poll)."""
        bridge, self.bridge = self.bridge, None
        bridge.ended.disconnect(self._on_ended)
        bridge.events.disconnect(self._on_events)
        bridge.detach()
        bridge.wait(2000)
        self._set_phase("idle")

    # ---- closing the app -------------------------------------------------------------------
    def ask_close(self) -> str | None:
        """Ask what to do with a run in progress: "stop", "background", "abort" or None."""
        box = QMessageBox(self)
        box.setIcon(QMessageBox.Icon.Question)
        box.setWindowTitle("A run is in progress")
        box.setText("A training run is in progress. What should happen to it?")
        box.setInformativeText("Keep training: the engine carries on without the app; open "
                               "the app again and follow it from the Runs page.")
        choices = {box.addButton("Stop and save", QMessageBox.ButtonRole.AcceptRole): "stop",
                   box.addButton("Keep training", QMessageBox.ButtonRole.AcceptRole):
                       "background",
                   box.addButton("Abort without saving", QMessageBox.ButtonRole.DestructiveRole):
                       "abort"}
        box.addButton(QMessageBox.StandardButton.Cancel)
        box.exec()
        return choices.get(box.clickedButton())

    def confirm_close(self) -> bool:
        """Called by the main window before it closes; False keeps it open."""
        bridge = self.bridge
        if bridge is None:
            return True
        choice = self.ask_close() if bridge.owned and self.phase in ACTIVE else "background"
        if choice is None:
            return False
        if choice == "stop":
            bridge.stop_and_save()
        elif choice == "abort":
            bridge.abort()
        bridge.ended.disconnect(self._on_ended)
        bridge.detach()
        bridge.wait(3000)  # the commands are carried out before the app goes
        self.bridge = None
        return True

    # ---- events ----------------------------------------------------------------------------
    @Slot(list)
    def _on_events(self, events: list) -> None:
        self.dashboard.add_events(events)
        speeds = [ev.tokens_per_s for ev in events if isinstance(ev, StepMetrics)
                  and ev.tokens_per_s and ev.step > 1]  # step 1 carries the warm-up
        if speeds and self.run_plan is not None:
            for tps in speeds:  # smoothed like the CLI's progress bar
                old = self._measured_tps
                self._measured_tps = tps if old is None else 0.3 * tps + 0.7 * old
            self._show_plan()
        for ev in events:
            if isinstance(ev, RunState) and ev.state in STATE_TEXT:
                self._set_phase(ev.state)
                self._show_status("info" if ev.state == "paused" else "busy",
                                  f"{STATE_TEXT[ev.state]}  {short_path(self.run_dir)}")

    @Slot(object)
    def _on_ended(self, end: RunEnd) -> None:
        self.bridge = None
        self.end = end
        self._set_phase("ended")
        self.dashboard.repaint_all()
        last = self.dashboard.history.last
        step = last.step if last is not None else 0
        if end.outcome in ("finished", "stopped"):
            final = self.run_dir / "final"
            where = f" The fine-tuned model is in {short_path(final)}." if final.is_dir() else ""
            verb = "Finished" if end.outcome == "finished" else f"Stopped at step {step}"
            self._show_status("ok", f"{verb}.{where}")
        elif end.outcome == "detached":
            self._show_status("info", f"No longer following {short_path(self.run_dir)}; the "
                                      f"engine carries on. The Runs page lists it.")
        elif last is None and latest_checkpoint(self.run_dir) is None:  # refused in set-up
            self._show_status("error", f"The run could not start: nothing was trained. "
                                       f"{end.message}")
            if end.log_tail:
                self.dashboard.show_failure_log(end.log_tail)
        else:
            checkpoint = latest_checkpoint(self.run_dir)
            resume = ("It can continue from its checkpoint at step "
                      f"{checkpoint}: Resume run." if checkpoint is not None else
                      "It has no checkpoint to continue from.")
            self._show_status("error", f"The run stopped unexpectedly at step {step}. "
                                       f"{end.message}\n{resume}")
            if end.log_tail:
                self.dashboard.show_failure_log(end.log_tail)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
        self.dashboard.running = phase == "running"
        self.dashboard.check_stall()
        self._update_buttons()

    def _update_buttons(self) -> None:
        active = self.bridge is not None
        owned = active and self.bridge.owned
        self.start_button.setEnabled(not active and self._ready() is None)
        self.start_button.setToolTip(self._ready() or "Start a new run with these settings")
        self.pause_button.setEnabled(active and self.phase in ("running", "paused"))
        self.pause_button.setText("Resume" if self.phase in ("paused", "resuming") else "Pause")
        self.stop_button.setEnabled(active and self.phase in ("setup", "running", "paused",
                                                              "pausing"))
        self.detach_button.setVisible(active and not owned)
        self.resume_button.setVisible(
            not active and self.run_dir is not None and self.end is not None
            and self.end.outcome in ("failed", "interrupted", "stopped")
            and latest_checkpoint(self.run_dir) is not None)
        self.open_button.setEnabled(self.run_dir is not None)
        self.settings.setEnabled(not active)
        self.command_button.setEnabled(not active)

    def _show_status(self, state: str, text: str) -> None:
        self.dashboard.show_status(state, text)
