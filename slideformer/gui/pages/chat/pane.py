"""One conversation with one model: its model list, its child process and its transcript.

The Chat page holds one pane, or two side by side ("base vs tuned"): each has its own model,
process (:class:`~slideformer.gui.workers.chat.ChatProcess`) and conversation, and the page sends
the same message to every pane shown. The transcript is repainted from :meth:`ChatPane.flush`,
which the page calls on a clock, not once per token.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (QComboBox, QFileDialog, QHBoxLayout, QPushButton, QTextBrowser,
                               QVBoxLayout, QWidget)

from slideformer.gui.workers.chat import ChatProcess, chat_argv
from slideformer.gui.models.chat import ModelChoice
from slideformer.gui.pages.chat.transcript import Turn, messages_for_engine, render_html, reply_note
from slideformer.gui.models.formatting import short_path
from slideformer.gui.widgets.common import set_state, status_label

EMPTY = "Pick a model above and type a message below."


def mode_words(info: dict) -> str:
    """How the model runs, for the pane's status line."""
    where = f"{info.get('device', '?')}, {info.get('dtype', '?')}"
    if info.get("mode") == "streamed":
        return (f"streamed through the layer window on {where}: every token reads all "
                f"{info.get('layers', '?')} layers again (slow)")
    return f"resident on {where}, KV cache"


class ChatPane(QWidget):
    """A model picker, a status line and a transcript; talks to one child process."""

    busy_changed = Signal(bool)
    """A reply started (True) or ended (False)."""

    def __init__(self, argv_for: Callable[[str], list[str]] = chat_argv, parent=None):
        super().__init__(parent)
        self.argv_for = argv_for
        self.proc: ChatProcess | None = None
        self.turns: list[Turn] = []
        self.request: int | None = None
        self.pending: tuple[list[dict], dict] | None = None
        """A request waiting for the model to finish loading."""
        self.theme = "light"
        self._dirty = True

        self.models = QComboBox()
        self.models.setMinimumContentsLength(24)
        self.models.setSizeAdjustPolicy(QComboBox.SizeAdjustPolicy.AdjustToMinimumContentsLengthWithIcon)
        self.models.currentIndexChanged.connect(self._model_chosen)
        self.browse = QPushButton("Folder…")
        self.browse.setToolTip("Chat with another model folder or checkpoint")
        self.browse.clicked.connect(self.choose_folder)
        self.status = status_label("No model yet.")
        set_state(self.status, "info")
        self.view = QTextBrowser()
        self.view.setOpenLinks(False)

        top = QHBoxLayout()
        top.addWidget(self.models, 1)
        top.addWidget(self.browse)
        lay = QVBoxLayout(self)
        lay.setContentsMargins(0, 0, 0, 0)
        lay.addLayout(top)
        lay.addWidget(self.status)
        lay.addWidget(self.view, 1)
        self.flush()

    # ---- the model -----------------------------------------------------------------------------
    @property
    def model_path(self) -> str | None:
        data = self.models.currentData()
        return str(data) if data else None

    def set_choices(self, choices: list[ModelChoice], prefer: str | None = None) -> None:
        """Fill the model list, keeping the current model (else ``prefer``, else the first)."""
        keep = self.model_path or prefer
        self.models.blockSignals(True)
        self.models.clear()
        for c in choices:
            self.models.addItem(c.label, c.path)
            self.models.setItemData(self.models.count() - 1, c.path, 3)  # tooltip: the path
        if keep and self.models.findData(keep) < 0:
            self.models.addItem(Path(keep).name, keep)
        self.models.setCurrentIndex(max(0, self.models.findData(keep)) if keep else 0)
        self.models.blockSignals(False)
        if self.model_path != (self.proc.model_path if self.proc else None):
            self._model_chosen()

    def select(self, path: str) -> None:
        if self.models.findData(path) < 0:
            self.models.addItem(Path(path).name, path)
        self.models.setCurrentIndex(self.models.findData(path))

    def choose_folder(self) -> None:
        path = QFileDialog.getExistingDirectory(self, "Choose a model folder or checkpoint",
                                                str(Path.home()))
        if path:
            self.select(path)

    def _model_chosen(self, *_) -> None:
        self.shutdown()
        path = self.model_path
        if path is None:
            return
        if self.turns:  # the conversation goes on with the new model
            self.turns.append(Turn("notice", f"Now talking to {short_path(path)}."))
        self._dirty = True
        self.start()

    def start(self) -> None:
        """Start the child process for the chosen model (it loads in the background)."""
        path = self.model_path
        if path is None or (self.proc is not None and self.proc.running):
            return
        self.proc = ChatProcess(path, self.argv_for(path), parent=self)
        self.proc.ready.connect(self._ready)
        self.proc.token.connect(self._token)
        self.proc.done.connect(self._done)
        self.proc.failed.connect(self._failed)
        self.proc.ended.connect(self._ended)
        self._set_status(f"Loading {Path(path).name}…", "busy")
        self.proc.start()

    def shutdown(self) -> None:
        """End the child process (a reply in progress is kept as far as it came)."""
        if self.proc is not None:
            proc, self.proc = self.proc, None
            proc.ended.disconnect(self._ended)
            proc.close()
            proc.deleteLater()
        self._end_reply("stopped: model closed")

    # ---- the conversation ----------------------------------------------------------------------
    @property
    def busy(self) -> bool:
        return self.request is not None or self.pending is not None

    def send(self, text: str, settings: dict) -> None:
        """Add the user's message and ask the model for a reply."""
        self.turns.append(Turn("user", text))
        messages = messages_for_engine(self.turns)
        self.turns.append(Turn("assistant", live=True))
        self._dirty = True
        self.pending = (messages, settings)
        self.busy_changed.emit(True)
        if self.proc is None or not self.proc.running:
            self.start()
        elif self.proc.info is not None:
            self._send_pending()

    def _send_pending(self) -> None:
        if self.pending is not None and self.proc is not None:
            messages, settings = self.pending
            self.pending = None
            self.request = self.proc.generate(messages, settings)

    def stop(self) -> None:
        if self.request is not None and self.proc is not None:
            self.proc.stop(self.request)
        elif self.pending is not None:
            self.pending = None
            self._end_reply("stopped before it started")

    def clear(self) -> None:
        """A new conversation (a reply in progress is stopped first)."""
        self.stop()
        self.turns.clear()
        self._dirty = True

    def _live(self) -> Turn | None:
        return self.turns[-1] if self.turns and self.turns[-1].live else None

    def _end_reply(self, note: str, error: bool = False) -> None:
        """Close the reply in progress, if any, with ``note``."""
        turn = self._live()
        was_busy = self.busy
        self.request, self.pending = None, None
        if turn is not None:
            turn.live, turn.note, turn.error = False, note, error
            self._dirty = True
        if was_busy:
            self.busy_changed.emit(False)

    # ---- the child's signals -------------------------------------------------------------------
    def _ready(self, info: dict) -> None:
        self._set_status(f"{self.models.currentText()}: {info.get('family', '?')}, "
                         f"{info.get('layers', '?')} layers, {mode_words(info)}.", "ok")
        self._send_pending()

    def _token(self, rid: int, text: str) -> None:
        turn = self._live()
        if rid == self.request and turn is not None:
            turn.text += text
            self._dirty = True

    def _done(self, rid: int, done: dict) -> None:
        if rid != self.request:
            return
        info = self.proc.info if self.proc is not None else {}
        self._end_reply(reply_note(done, info.get("mode", "")))
        if done.get("tokens_per_s"):
            self._set_status(f"{self.models.currentText()}: {mode_words(info)}; last reply "
                             f"{done['tokens_per_s']:.1f} tok/s.", "ok")

    def _failed(self, rid: int, message: str) -> None:
        if rid == self.request:
            self._end_reply(message, error=True)

    def _ended(self, message: str) -> None:
        self.proc = None
        self._end_reply(f"no reply: {message}", error=True)
        self._set_status(message or "The chat engine has ended.", "error")

    # ---- painting ------------------------------------------------------------------------------
    def _set_status(self, text: str, state: str) -> None:
        self.status.setText(text)
        set_state(self.status, state)

    def set_theme(self, theme: str) -> None:
        self.theme = theme
        self._dirty = True

    def flush(self) -> None:
        """Repaint the transcript if it changed since the last call."""
        if not self._dirty:
            return
        self._dirty = False
        self.view.setHtml(render_html(self.turns, self.theme, EMPTY))
        bar = self.view.verticalScrollBar()
        bar.setValue(bar.maximum())
