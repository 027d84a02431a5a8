"""The Train page: settings and presets, start / pause / resume / stop-and-save, and a live
dashboard of the run (progress and ETA, loss, learning rate, gradient norm, throughput, memory,
the pipeline timeline of the latest step, the engine's messages).

The run is an engine process owned by an :class:`~slideformer_gui.engine_bridge.EngineBridge`;
its events land in a :class:`~slideformer_gui.train_metrics.StepHistory`, and the charts repaint
from it on a :data:`REPAINT_HZ` clock. The page can also show a run it did not start (the Runs
page's "Follow"), or resume a stopped or crashed one from its last checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, QUrl, Signal, Slot
from PySide6.QtGui import QDesktopServices, QFont
from PySide6.QtWidgets import (QFrame, QGridLayout, QGroupBox, QHBoxLayout, QLabel,
                               QMessageBox, QPlainTextEdit, QProgressBar, QPushButton,
                               QScrollArea, QSplitter, QTabWidget, QVBoxLayout, QWidget)

from engine.events import (CheckpointSaved, EvalMetrics, Log, Progress, RunState, StepMetrics,
                           Timeline)
from slideformer_gui.context import AppContext
from slideformer_gui.engine_bridge import EngineBridge, RunEnd, launch_argv
from slideformer_gui.formatting import short_path
from slideformer_gui.run_files import CONFIG_FILE, LOG_FILE, latest_checkpoint
from slideformer_gui.theme import PLOT_COLORS
from slideformer_gui.train_metrics import StepHistory, format_seconds, now, progress, \
    stall_seconds
from slideformer_gui.train_plots import METRICS, MetricPlot, TimelineView
from slideformer_gui.train_settings import CommandDialog, RunSettings, write_config
from slideformer_gui.widgets import fixed_width, page_header, set_state

REPAINT_HZ = 20
"""Repaint clock. Each tick repaints at most one chart whose data changed, in turn: painting
all six at once took 35 ms of the GUI thread on the 2-core CI machine, one takes 2-3 ms."""
LOG_LINES = 500
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

    run_started = Signal(str)
    """An engine process was started (or a run followed): its run folder."""
    run_ended = Signal(object)
    """The page's run ended or was let go: a :class:`RunEnd`."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.bridge: EngineBridge | None = None
        self.run_dir: Path | None = None
        self.phase = "idle"
        self.history = StepHistory()
        self.end: RunEnd | None = None
        self._timeline: Timeline | None = None
        self._shown_timeline: Timeline | None = None
        self._step_times: dict[int, float] = {}
        self._painted: dict[str, int] = {}
        """Chart name -> history version it shows."""
        self._turn = 0
        self._last_event_at = now()

        self.settings = RunSettings()
        self.settings.changed.connect(self._settings_changed)
        self.settings.preset_applied.connect(self._preset_applied)
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
        scroll = QScrollArea()
        scroll.setWidget(settings_box)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        # As wide as the form needs: the column scrolls vertically, never clips sideways.
        scroll.setMinimumWidth(settings_box.minimumSizeHint().width()
                               + scroll.verticalScrollBar().sizeHint().width())

        splitter = QSplitter(Qt.Orientation.Horizontal)
        splitter.addWidget(scroll)
        splitter.addWidget(self._build_dashboard())
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([scroll.minimumWidth(), 1000])
        splitter.setChildrenCollapsible(False)
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Train", "Fine-tune the chosen model on the chosen data. The "
                                           "run is an engine process of its own: the app stays "
                                           "responsive, and the run survives the app."))
        lay.addWidget(splitter, 1)

        self._repaint_timer = QTimer(self, interval=1000 // REPAINT_HZ)
        self._repaint_timer.timeout.connect(self._repaint)
        self._repaint_timer.start()
        self._stall_timer = QTimer(self, interval=1000)
        self._stall_timer.timeout.connect(self._check_stall)
        self._stall_timer.start()

        ctx.model_changed.connect(self._inputs_changed)
        ctx.data_changed.connect(self._inputs_changed)
        ctx.theme_changed.connect(lambda name: self.set_colors(*PLOT_COLORS[name]))
        ctx.run_requested.connect(self.open_run)
        self.set_colors(*PLOT_COLORS[ctx.settings.theme()])
        self._auto_output = ""
        """The run folder the page proposed; a folder the user typed is left alone."""
        self._new_output()
        self._inputs_changed()
        self._show_status("info", "Choose a model and a dataset, pick a preset, then Start.")

    def _build_dashboard(self) -> QWidget:
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

        self.status = QLabel("")
        self.status.setObjectName("status")
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.failure_log = QPlainTextEdit()
        self.failure_log.setReadOnly(True)
        self.failure_log.setFont(QFont("monospace", 8))
        self.failure_log.setMaximumHeight(130)
        self.failure_log.hide()
        self.progress_bar = QProgressBar()
        self.progress_bar.setTextVisible(False)
        self.progress_bar.setRange(0, 1000)
        self.progress_text = QLabel("")
        self.progress_text.setObjectName("progressText")
        fixed_width(self.progress_text)
        self.stall = QLabel("")
        self.stall.setObjectName("notice")
        self.stall.setWordWrap(True)
        self.stall.hide()

        self.plots = {name: MetricPlot(metric) for name, metric in METRICS.items()}
        grid = QGridLayout()
        grid.setSpacing(8)
        grid.addWidget(self.plots["loss"], 0, 0, 1, 2)
        grid.addWidget(self.plots["lr"], 0, 2)
        grid.addWidget(self.plots["grad_norm"], 1, 0)
        grid.addWidget(self.plots["tokens_per_s"], 1, 1)
        grid.addWidget(self.plots["memory"], 1, 2)
        for plot in self.plots.values():
            plot.plot.getPlotItem().setLabel("bottom", "step")

        self.timeline = TimelineView()
        self.log_view = QPlainTextEdit()
        self.log_view.setReadOnly(True)
        self.log_view.setMaximumBlockCount(LOG_LINES)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.timeline, "Pipeline of the latest step")
        self.tabs.addTab(self.log_view, "Engine messages")

        box = QWidget()
        lay = QVBoxLayout(box)
        lay.setContentsMargins(4, 0, 0, 0)
        lay.addLayout(controls)
        lay.addWidget(self.status)
        lay.addWidget(self.failure_log)
        lay.addWidget(self.progress_bar)
        lay.addWidget(self.progress_text)
        lay.addWidget(self.stall)
        lay.addLayout(grid, 3)
        lay.addWidget(self.tabs, 2)
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
        self._new_output()

    def resume_run(self, run_dir: Path | str) -> None:
        """Continue a stopped or crashed run from its newest checkpoint."""
        run_dir = Path(run_dir)
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

    def _launch(self, run_dir: Path, argv: list[str] | None) -> None:
        self.run_dir = run_dir
        self.history = StepHistory()
        self._timeline = self._shown_timeline = None
        self._step_times.clear()
        self._painted.clear()
        self.end = None
        for plot in self.plots.values():
            plot.clear()
        self.timeline.clear()
        self.log_view.clear()
        self.failure_log.hide()
        self.stall.hide()
        self.progress_bar.setValue(0)
        self.progress_text.setText("")
        self.bridge = EngineBridge(run_dir, argv, parent=self)
        self.bridge.events.connect(self._on_events)
        self.bridge.ended.connect(self._on_ended)
        self.bridge.finished.connect(self.bridge.deleteLater)
        self._last_event_at = now()
        self._set_phase("starting" if argv is not None else "setup")
        self._show_status("busy", f"{STATE_TEXT['starting']}  {short_path(run_dir)}")
        self.bridge.start()
        self.run_started.emit(str(run_dir))

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
        self._last_event_at = now()
        for ev in events:
            if isinstance(ev, (StepMetrics, EvalMetrics)):
                self.history.add(ev)
                if isinstance(ev, StepMetrics):
                    self._step_times[ev.step] = ev.step_time
            elif isinstance(ev, Timeline):
                self._timeline = ev
            elif isinstance(ev, RunState):
                self._on_state(ev)
            elif isinstance(ev, Log):
                self._log(f"{ev.level}: {ev.message}" if ev.level != "info" else ev.message, ev)
            elif isinstance(ev, Progress) and self.phase == "setup":
                total = f" / {ev.total:,}" if ev.total else ""
                self.progress_text.setText(f"{ev.task}: {ev.done:,}{total}")
            elif isinstance(ev, CheckpointSaved):
                self._log(f"checkpoint saved at step {ev.step}", ev)
        if len(self._step_times) > 64:
            for step in sorted(self._step_times)[:-8]:
                del self._step_times[step]

    def _on_state(self, ev: RunState) -> None:
        self._log(f"[{ev.state}] {ev.message}".rstrip(), ev)
        if ev.state in STATE_TEXT:
            self._set_phase(ev.state)
            self._show_status("busy" if ev.state != "paused" else "info",
                              f"{STATE_TEXT[ev.state]}  {short_path(self.run_dir)}")

    def _log(self, text: str, ev) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(ev.time))
        self.log_view.appendPlainText(f"{stamp}  {text}")

    @Slot(object)
    def _on_ended(self, end: RunEnd) -> None:
        self.bridge = None
        self.end = end
        self.repaint_all()
        self.stall.hide()
        step = self.history.last.step if self.history.last else 0
        if end.outcome in ("finished", "stopped"):
            final = self.run_dir / "final"
            where = f" The fine-tuned model is in {short_path(final)}." if final.is_dir() else ""
            verb = "Finished" if end.outcome == "finished" else f"Stopped at step {step}"
            self._show_status("ok", f"{verb}.{where}")
        elif end.outcome == "detached":
            self._show_status("info", f"No longer following {short_path(self.run_dir)}; the "
                                      f"engine carries on. The Runs page lists it.")
        else:
            checkpoint = latest_checkpoint(self.run_dir)
            resume = ("It can continue from its checkpoint at step "
                      f"{checkpoint}: Resume run." if checkpoint is not None else
                      "It has no checkpoint to continue from.")
            self._show_status("error", f"The run stopped unexpectedly at step {step}. "
                                       f"{end.message}\n{resume}")
            if end.log_tail:
                self.failure_log.setPlainText(
                    f"Last lines of {short_path(self.run_dir / LOG_FILE)}:\n{end.log_tail}")
                self.failure_log.show()
        self._set_phase("ended")
        self.run_ended.emit(end)

    def _set_phase(self, phase: str) -> None:
        self.phase = phase
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

    # ---- painting --------------------------------------------------------------------------
    def _repaint(self) -> None:
        """One tick of the repaint clock: the progress line, then the next stale chart."""
        if not self.isVisible():
            return
        version = self.history.version
        if self._painted.get("progress") != version:
            self._painted["progress"] = version
            shown = progress(self.history)
            if shown is not None:
                self.progress_bar.setValue(round(1000 * shown.fraction))
                self.progress_text.setText(shown.text)
        names = list(self.plots) + ["timeline"]
        for i in range(len(names)):
            name = names[(self._turn + i) % len(names)]
            if name == "timeline":
                if self._timeline is not self._shown_timeline:
                    self._shown_timeline = self._timeline
                    self.timeline.show_timeline(self._timeline, self._step_times.get(self._timeline.step))
                    break
            elif self._painted.get(name) != version:
                self._painted[name] = version
                self.plots[name].repaint_from(self.history)
                break
        self._turn = (self._turn + i + 1) % len(names)

    def repaint_all(self) -> None:
        """Bring every chart up to date now (screenshots, the end of a run)."""
        for _ in range(len(self.plots) + 2):
            self._repaint()

    def _check_stall(self) -> None:
        if self.phase != "running":
            self.stall.hide()
            return
        since = now() - self._last_event_at
        stalled = stall_seconds(self.history, since)
        if stalled is None:
            self.stall.hide()
            return
        usual = self.history.usual_step_time()
        self.stall.setText(f"No progress for {format_seconds(stalled)}, against "
                           f"{format_seconds(usual)} per step until now. The engine may be "
                           f"stuck (or writing a large checkpoint). Its log: "
                           f"{short_path(self.run_dir / LOG_FILE)}")
        self.stall.show()

    def _show_status(self, state: str, text: str) -> None:
        self.status.setText(text)
        set_state(self.status, state)

    def set_colors(self, background: str, foreground: str) -> None:
        for plot in self.plots.values():
            plot.set_colors(background, foreground)
        self.timeline.set_colors(background, foreground)
