"""The Train page's dashboard: what one run's events show -- status, progress and time left,
the metric charts, the pipeline timeline of the latest step, the engine's messages, and a
warning when the run stops making progress.

Events go into a :class:`~slideformer.gui.models.metrics.StepHistory` as they arrive
(:meth:`Dashboard.add_events`); the charts repaint from it on a :data:`REPAINT_HZ` clock, one
stale chart per tick. The dashboard shows a run; starting and steering it is the page's job.
"""
from __future__ import annotations

import time
from pathlib import Path

from PySide6.QtCore import QTimer
from PySide6.QtGui import QFont
from PySide6.QtWidgets import (QGridLayout, QLabel, QPlainTextEdit, QProgressBar, QStackedWidget,
                               QTabWidget, QVBoxLayout, QWidget)

from slideformer.engine.api import (CheckpointSaved, EvalMetrics, Log, PairMetrics, Progress,
                                   RolloutMetrics, RunState, StepMetrics, Timeline)
from slideformer.gui.models.formatting import short_path
from slideformer.gui.models.runs import LOG_FILE
from slideformer.gui.models.metrics import StepHistory, format_seconds, now, progress, \
    stall_seconds
from slideformer.gui.widgets.plots import METRICS, MetricPlot, TimelineView
from slideformer.gui.widgets.common import fixed_width, set_state, status_label

REPAINT_HZ = 20
"""Repaint clock. Each tick repaints at most one chart whose data changed, in turn: painting
all six at once took 35 ms of the GUI thread on the 2-core CI machine, one takes 2-3 ms."""
LOG_LINES = 500


class Dashboard(QWidget):
    """Status line, progress, charts, timeline and messages of the run in :attr:`run_dir`."""

    def __init__(self, parent=None):
        super().__init__(parent)
        self.run_dir: Path | None = None
        self.history = StepHistory()
        self._timeline: Timeline | None = None
        self._shown_timeline: Timeline | None = None
        self._step_times: dict[int, float] = {}
        self._painted: dict[str, int] = {}
        """Chart name -> history version it shows."""
        self._turn = 0
        self._last_event_at = now()
        self._running = False
        """Steps are expected (the stall watch is on)."""

        self._build_status()
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        for w in (self.status, self.failure_log, self.progress_bar, self.progress_text,
                  self.stall):
            lay.addWidget(w)
        lay.addLayout(self._build_charts(), 3)
        lay.addWidget(self._build_tabs(), 2)

        self._start_clocks()

    def _build_status(self) -> None:
        """The status line, the failure log, progress and the stall warning."""
        self.status = status_label()
        self.failure_log = QPlainTextEdit()
        self.failure_log.setReadOnly(True)
        self.failure_log.setFont(QFont("monospace", 8))
        self.failure_log.setMaximumHeight(130)
        self.failure_log.hide()
        self.progress_bar = QProgressBar()
        self.progress_bar.setTextVisible(False)
        self.progress_bar.setRange(0, 1000)
        self.progress_text = fixed_width(QLabel(""))
        self.stall = QLabel("")
        self.stall.setObjectName("notice")
        self.stall.setWordWrap(True)
        self.stall.hide()

    def _build_charts(self) -> QGridLayout:
        """The metric charts: loss across the top, the others below it."""
        self.plots = {name: MetricPlot(metric) for name, metric in METRICS.items()}
        grid = QGridLayout()
        grid.setSpacing(8)
        grid.addWidget(self.plots["loss"], 0, 0, 1, 2)
        self.corner = QStackedWidget()  # learning rate; a preference or GRPO run's rewards
        self.corner.addWidget(self.plots["lr"])
        self.corner.addWidget(self.plots["rewards"])
        self.corner.addWidget(self.plots["reward"])
        grid.addWidget(self.corner, 0, 2)
        grid.addWidget(self.plots["grad_norm"], 1, 0)
        grid.addWidget(self.plots["tokens_per_s"], 1, 1)
        grid.addWidget(self.plots["memory"], 1, 2)
        for plot in self.plots.values():
            plot.plot.getPlotItem().setLabel("bottom", "step")
        return grid

    def _build_tabs(self) -> QTabWidget:
        """The latest step's pipeline timeline and the engine's messages."""
        self.timeline = TimelineView()
        self.log_view = QPlainTextEdit()
        self.log_view.setReadOnly(True)
        self.log_view.setMaximumBlockCount(LOG_LINES)
        self.tabs = QTabWidget()
        self.tabs.addTab(self.timeline, "Pipeline of the latest step")
        self.tabs.addTab(self.log_view, "Engine messages")
        return self.tabs

    def _start_clocks(self) -> None:
        """The repaint clock (REPAINT_HZ) and the stall watch (once a second)."""
        self._repaint_timer = QTimer(self, interval=1000 // REPAINT_HZ)
        self._repaint_timer.timeout.connect(self._repaint)
        self._repaint_timer.start()
        self._stall_timer = QTimer(self, interval=1000)
        self._stall_timer.timeout.connect(self.check_stall)
        self._stall_timer.start()

    def reset(self, run_dir: Path) -> None:
        """Forget the previous run; show ``run_dir`` from now on."""
        self.run_dir = run_dir
        self.history = StepHistory()
        self.corner.setCurrentIndex(0)
        self._timeline = self._shown_timeline = None
        self._step_times.clear()
        self._painted.clear()
        self._last_event_at = now()
        for plot in self.plots.values():
            plot.clear()
        self.timeline.clear()
        self.log_view.clear()
        self.failure_log.hide()
        self.stall.hide()
        self.progress_bar.setValue(0)
        self.progress_text.setText("")

    def add_events(self, events: list) -> None:
        """Take new events of the run (the page handles RunState; here it is only logged)."""
        self._last_event_at = now()
        for ev in events:
            if isinstance(ev, (StepMetrics, EvalMetrics, PairMetrics, RolloutMetrics)):
                self.history.add(ev)
                self.corner.setCurrentIndex(2 if self.history.has_rollouts
                                            else int(self.history.has_pairs))
                if isinstance(ev, StepMetrics):
                    self._step_times[ev.step] = ev.step_time
            elif isinstance(ev, Timeline):
                self._timeline = ev
            elif isinstance(ev, RunState):
                self.log(f"[{ev.state}] {ev.message}".rstrip(), ev.time)
            elif isinstance(ev, Log):
                self.log(ev.message if ev.level == "info" else f"{ev.level}: {ev.message}",
                         ev.time)
            elif isinstance(ev, Progress) and self.history.last is None:
                total = f" / {ev.total:,}" if ev.total else ""
                self.progress_text.setText(f"{ev.task}: {ev.done:,}{total}")
            elif isinstance(ev, CheckpointSaved):
                best = " (the lowest validation loss so far: kept)" if ev.best else ""
                self.log(f"checkpoint saved at step {ev.step}{best}", ev.time)
        if len(self._step_times) > 64:
            for step in sorted(self._step_times)[:-8]:
                del self._step_times[step]

    def log(self, text: str, when: float) -> None:
        stamp = time.strftime("%H:%M:%S", time.localtime(when))
        self.log_view.appendPlainText(f"{stamp}  {text}")

    def show_status(self, state: str, text: str) -> None:
        """The status line: ``state`` is info, busy, ok or error (the style sheet's colours)."""
        self.status.setText(text)
        set_state(self.status, state)

    def show_failure_log(self, tail: str) -> None:
        self.failure_log.setPlainText(f"Last lines of {short_path(self.run_dir / LOG_FILE)}:\n"
                                      f"{tail}")
        self.failure_log.show()

    # ---- painting --------------------------------------------------------------------------
    def _repaint(self) -> None:
        """One tick of the repaint clock: the progress line, then the next stale chart."""
        if not self.isVisible():
            return
        version = self.history.version
        if self._painted.get("progress") != version:
            self._painted["progress"] = version
            shown = progress(self.history, self._running)
            if shown is not None:
                self.progress_bar.setValue(round(1000 * shown.fraction))
                self.progress_text.setText(shown.text)
        names = list(self.plots) + ["timeline"]
        for i in range(len(names)):
            name = names[(self._turn + i) % len(names)]
            if name == "timeline":
                if self._timeline is not self._shown_timeline:
                    self._shown_timeline = tl = self._timeline
                    self.timeline.show_timeline(tl, self._step_times.get(tl.step))
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

    @property
    def running(self) -> bool:
        """The run is training now (not paused, stopping or ended): the time left counts."""
        return self._running

    @running.setter
    def running(self, on: bool) -> None:
        if on != self._running:
            self._running = on
            self._painted.pop("progress", None)  # rewrite the progress line at the next tick

    def check_stall(self) -> None:
        """Show or hide the warning of a run that stopped making progress."""
        stalled = stall_seconds(self.history, now() - self._last_event_at) if self.running \
            else None
        if stalled is None:
            self.stall.hide()
            return
        usual = self.history.usual_step_time()
        self.stall.setText(f"No progress for {format_seconds(stalled)}, against "
                           f"{format_seconds(usual)} per step until now. The engine may be "
                           f"stuck (or writing a large checkpoint). Its log: "
                           f"{short_path(self.run_dir / LOG_FILE)}")
        self.stall.show()

    def set_colors(self, background: str, foreground: str) -> None:
        for plot in self.plots.values():
            plot.set_colors(background, foreground)
        self.timeline.set_colors(background, foreground)
