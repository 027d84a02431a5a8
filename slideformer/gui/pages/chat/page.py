"""The Chat page: talk to a model -- the chosen one, or any run's final model or checkpoint.

One conversation, or two side by side ("base vs tuned") getting the same messages. Each model
runs in a child process of its own (:mod:`slideformer.gui.workers.chat`); replies stream in and
the transcripts repaint on a clock (:data:`REPAINT_MS`). The sampling settings apply to the next
message; the model's own chat template formats the conversation (in the engine).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from PySide6.QtCore import Qt, QTimer, Slot
from PySide6.QtGui import QKeySequence, QShortcut
from PySide6.QtWidgets import (QComboBox, QDoubleSpinBox, QFormLayout, QHBoxLayout, QLabel,
                               QPlainTextEdit, QPushButton, QSpinBox, QSplitter, QVBoxLayout,
                               QWidget)

from slideformer.gui.workers.chat import chat_argv
from slideformer.gui.models.chat import model_choices
from slideformer.gui.pages.chat.pane import ChatPane
from slideformer.gui.context import AppContext
from slideformer.gui.models.runs import scan_runs
from slideformer.gui.workers.thread import run_task
from slideformer.gui.widgets.common import page_header

REPAINT_MS = 66
"""Transcripts repaint at 15 Hz at most, however fast tokens come."""
MODES = (("single", "One model"), ("side", "Side by side"))


class ChatPage(QWidget):
    """Model pickers, sampling settings, one or two transcripts and the message box.

    Args:
        argv_for: the command serving a model folder (tests pass a stand-in engine).
    """

    def __init__(self, ctx: AppContext, argv_for: Callable[[str], list[str]] = chat_argv,
                 parent=None):
        super().__init__(parent)
        self.ctx = ctx
        self.choices = []
        self._second_prefer: str | None = None
        """The model the second pane starts on when side by side is first turned on."""
        self._scanning = False
        self.panes = [ChatPane(argv_for), ChatPane(argv_for)]
        for pane in self.panes:
            pane.busy_changed.connect(self._update_buttons)
        self.panes[1].hide()

        settings = self._build_settings()
        self.splitter = QSplitter(Qt.Orientation.Horizontal)
        for pane in self.panes:
            self.splitter.addWidget(pane)
        self.splitter.setChildrenCollapsible(False)

        row = self._build_input()
        lay = QVBoxLayout(self)
        lay.addWidget(page_header("Chat", "Talk to a model: the chosen one, or a run's final "
                                          "model or checkpoint. Side by side sends the same "
                                          "messages to two models, e.g. base vs tuned."))
        lay.addLayout(settings)
        lay.addWidget(self.splitter, 1)
        lay.addLayout(row)
        self.hint = QLabel("Generation runs in a separate engine process per model; the "
                           "model's own chat template formats the conversation.")
        self.hint.setObjectName("hint")
        lay.addWidget(self.hint)

        self._clock = QTimer(self, interval=REPAINT_MS)
        self._clock.timeout.connect(self._repaint)
        self._clock.start()
        ctx.model_changed.connect(lambda _path: self.refresh_models())
        ctx.theme_changed.connect(self._set_theme)
        self._update_buttons()

    def _build_settings(self) -> QHBoxLayout:
        """The compare mode and the sampling settings, in one row."""
        self.mode = QComboBox()
        for key, label in MODES:
            self.mode.addItem(label, key)
        self.mode.setToolTip("Side by side: the same messages to two models (base vs tuned)")
        self.mode.currentIndexChanged.connect(self._mode_changed)
        self.temperature = QDoubleSpinBox(decimals=2, minimum=0.0, maximum=2.0, singleStep=0.1,
                                          value=0.7)
        self.temperature.setToolTip("0 = greedy: always the most likely token")
        self.top_p = QDoubleSpinBox(decimals=2, minimum=0.05, maximum=1.0, singleStep=0.05,
                                    value=0.9)
        self.top_p.setToolTip("Sample only among the most likely tokens up to this probability")
        self.max_tokens = QSpinBox(minimum=1, maximum=8192, singleStep=64, value=256)
        self.max_tokens.setToolTip("The longest reply, in tokens")
        self.seed = QSpinBox(minimum=0, maximum=999_999, value=0)
        self.seed.setToolTip("The same message, settings and seed give the same reply")
        settings = QHBoxLayout()
        for label, widget in (("Compare", self.mode), ("Temperature", self.temperature),
                              ("Top-p", self.top_p), ("Max tokens", self.max_tokens),
                              ("Seed", self.seed)):
            form = QFormLayout()
            form.setContentsMargins(0, 0, 0, 0)
            form.addRow(label, widget)
            settings.addLayout(form)
        settings.addStretch(1)
        return settings

    def _build_input(self) -> QHBoxLayout:
        """The message box and its buttons."""
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Message (Ctrl+Enter sends)")
        self.input.setFixedHeight(64)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.clear_button = QPushButton("New chat")
        self.clear_button.clicked.connect(self.clear)
        buttons = QVBoxLayout()
        for b in (self.send_button, self.stop_button, self.clear_button):
            buttons.addWidget(b)
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addLayout(buttons)
        for keys in ("Ctrl+Return", "Ctrl+Enter"):
            QShortcut(QKeySequence(keys), self.input, activated=self.send)
        return row

    # ---- models --------------------------------------------------------------------------------
    @Slot()
    def refresh_models(self) -> None:
        """List the chosen model and every run's results again (runs read on a worker thread)."""
        if self._scanning:
            return
        self._scanning = True
        extra = [Path(p) for p in self.ctx.settings.extra_runs()]
        run_task(scan_runs, [self.ctx.runs_dir], extra, name="chat-models", owner=self,
                 done=self._show_models, failed=lambda _msg: self._show_models([]))

    def _show_models(self, runs) -> None:
        self._scanning = False
        self.choices = model_choices(self.ctx.model_path, runs)
        first = self.choices[0].path if self.choices else None
        tuned = next((c.path for c in self.choices if c.kind == "final"), first)
        self.panes[0].set_choices(self.choices, prefer=first)
        if self.side_by_side:
            self.panes[1].set_choices(self.choices, prefer=tuned)
        else:
            self._second_prefer = tuned

    @property
    def side_by_side(self) -> bool:
        return self.mode.currentData() == "side"

    def _mode_changed(self) -> None:
        right = self.panes[1]
        right.setVisible(self.side_by_side)
        if self.side_by_side:
            right.set_choices(self.choices, prefer=self._second_prefer)
            right.start()
        self._update_buttons()

    # ---- the conversation ----------------------------------------------------------------------
    def shown_panes(self) -> list[ChatPane]:
        return self.panes if self.side_by_side else self.panes[:1]

    def sampling(self) -> dict:
        """The settings of the next reply, as the engine's SamplingConfig fields."""
        return {"temperature": self.temperature.value(), "top_p": self.top_p.value(),
                "max_new_tokens": self.max_tokens.value(), "seed": self.seed.value()}

    @Slot()
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        panes = [p for p in self.shown_panes() if p.model_path is not None]
        if not text or not panes or any(p.busy for p in panes):
            return
        self.input.clear()
        for pane in panes:
            pane.send(text, self.sampling())

    @Slot()
    def stop(self) -> None:
        for pane in self.panes:
            pane.stop()

    @Slot()
    def clear(self) -> None:
        for pane in self.panes:
            pane.clear()

    def _update_buttons(self, *_) -> None:
        busy = any(p.busy for p in self.shown_panes())
        self.send_button.setEnabled(not busy)
        self.stop_button.setEnabled(busy)

    # ---- painting and lifetime -----------------------------------------------------------------
    def _repaint(self) -> None:
        for pane in self.panes:
            pane.flush()

    def _set_theme(self, theme: str) -> None:
        for pane in self.panes:
            pane.set_theme(theme)

    def showEvent(self, event) -> None:
        super().showEvent(event)
        self.refresh_models()

    def confirm_close(self) -> bool:
        """The window closes: end the engine processes (nothing to save)."""
        for pane in self.panes:
            pane.shutdown()
        return True
