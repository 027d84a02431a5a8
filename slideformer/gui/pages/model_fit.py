"""The Model page's "What fits" box: the planner's verdict for full fine-tuning, LoRA and QLoRA
of the chosen model on the chosen machine (this one or a GPU preset), before anything loads.

The three plans are made by the app's planner process (:mod:`slideformer.gui.workers.planner`)
on a worker thread; an answer for a model, machine or sequence length that changed meanwhile
is dropped and the latest ones are planned instead.
"""
from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QComboBox, QFormLayout, QGroupBox, QLabel, QVBoxLayout

from slideformer.engine.api import RunConfig
from slideformer.gui.context import AppContext
from slideformer.gui.models.fit import (METHODS, VERDICT_STATES, VERDICT_TITLES, MethodFit,
                                        numbered_fits, targets)
from slideformer.gui.widgets.bars import STATE_COLORS
from slideformer.gui.widgets.common import set_state, status_label
from slideformer.gui.workers.planner import shared_planner
from slideformer.gui.workers.thread import run_task


class FitBox(QGroupBox):
    """Per-method verdicts of the context's model on the context's target machine."""

    def __init__(self, ctx: AppContext, parent=None):
        super().__init__("What fits", parent)
        self.ctx = ctx
        self.fits: tuple[MethodFit, ...] = ()
        """The verdicts on screen (empty until the first answer)."""
        self._version = 0
        """Bumped on every change of model, machine or sequence length."""
        self._asked: int | None = None
        """The version the planner is working on, or None."""

        self.target = QComboBox()
        for name, key in targets():
            self.target.addItem(name, key)
        self.target.setToolTip("This machine, or a GPU you may buy or rent (with the RAM of this "
                               "machine); the Plan page uses the same choice")
        self.target.setCurrentIndex(self.target.findData(ctx.target))
        self.target.currentIndexChanged.connect(
            lambda: ctx.set_target(self.target.currentData()))
        self.status = status_label("Choose a model to see which methods fit.")
        set_state(self.status, "info")
        self.verdicts: dict[str, QLabel] = {}
        form = QFormLayout()
        form.addRow("Plan for", self.target)
        for method, title in METHODS:
            verdict = QLabel("—")
            verdict.setTextFormat(Qt.TextFormat.RichText)
            verdict.setWordWrap(True)
            self.verdicts[method] = verdict
            form.addRow(title, verdict)
        self.note = QLabel("")
        self.note.setObjectName("hint")
        self.note.setWordWrap(True)
        lay = QVBoxLayout(self)
        lay.addLayout(form)
        lay.addWidget(self.status)
        lay.addWidget(self.note)

        ctx.model_changed.connect(self.refresh)
        ctx.target_changed.connect(self._target_changed)
        ctx.data_changed.connect(self._data_changed)
        self._seq_len = ctx.data_config.max_seq_len

    def _target_changed(self, target: str) -> None:
        self.target.blockSignals(True)
        self.target.setCurrentIndex(self.target.findData(target))
        self.target.blockSignals(False)
        self.refresh()

    def _data_changed(self) -> None:
        if self.ctx.data_config.max_seq_len != self._seq_len:
            self._seq_len = self.ctx.data_config.max_seq_len
            self.refresh()

    def settings(self) -> dict:
        """The run-config keys every method is planned with (the rest are the defaults)."""
        return {"data.max_seq_len": self.ctx.data_config.max_seq_len}

    def refresh(self, *_args) -> None:
        """Plan the three methods again (one request at a time; the latest inputs win)."""
        self._version += 1
        if self.ctx.model_path is None:
            return
        for label in self.verdicts.values():
            label.setEnabled(False)  # the verdicts on screen answer other inputs now
        self._show_status("busy", "Planning each method…")
        if self._asked is None:
            self._ask()

    def _ask(self) -> None:
        self._asked = version = self._version
        run_task(numbered_fits, version, shared_planner().plan, self.ctx.model_path,
                 self.settings(), self.ctx.target, name="method-fits", owner=self,
                 done=self._answered, failed=self._failed)

    def _failed(self, message: str) -> None:
        """A bug's message (the planner's own come with the answer): shown, not hidden."""
        self._asked = None
        self._show_status("error", message)

    def _answered(self, answer: tuple) -> None:
        version, fits, message = answer
        self._asked = None
        if version != self._version:  # the inputs changed meanwhile: plan them instead
            self._ask()
            return
        if message:
            self._show_status("error", message)
            return
        self.fits = fits
        for f in fits:
            color = STATE_COLORS[VERDICT_STATES[f.verdict]]
            label = self.verdicts[f.method]
            label.setText(f'<b style="color:{color}">{VERDICT_TITLES[f.verdict]}</b>: '
                          f'{f.reason}')
            label.setEnabled(True)
        self.status.hide()
        d = RunConfig()
        self.note.setText(f"Planned for sequences of {self.ctx.data_config.max_seq_len} tokens, "
                          f"micro-batch {d.train.micro_batch}, with the memory the machine has "
                          f"free. The Plan page varies them and shows where every byte goes; "
                          f"the Train page chooses the method.")

    def _show_status(self, state: str, text: str) -> None:
        self.status.setText(text)
        set_state(self.status, state)
        self.status.show()
