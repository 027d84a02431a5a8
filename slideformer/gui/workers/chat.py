"""The chat bridge: one model in a ``slideformer chat --json`` child process, seen as Qt signals.

Generation never runs in the app's process: a :class:`ChatProcess` starts the same command a
terminal user can run, writes requests to its stdin and turns the JSON lines it prints into
signals (slideformer/engine/generate/protocol.py has the protocol). It is a ``QProcess``, so the GUI thread
only ever handles "data arrived" notifications: it never waits on the child.
"""
from __future__ import annotations

import json

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, Signal

from slideformer.engine.api import engine_command, engine_env
from slideformer.gui.workers.run import exit_words, last_error

STDERR_KEEP = 8 << 10
"""Bytes of the child's stderr kept for the message shown when it dies."""


def chat_argv(model_path: str) -> list[str]:
    """The engine command that serves ``model_path`` to the app."""
    return engine_command("chat", "--model", model_path, "--json")


class ChatProcess(QObject):
    """One child process serving one model.

    Args:
        model_path: the folder it loads (a model folder or a training checkpoint).
        argv: the command to run (default :func:`chat_argv`; tests pass a stand-in).
    """

    ready = Signal(dict)
    """The model is loaded: its description (mode, device, layers...)."""
    token = Signal(int, str)
    """(request id, new text) of a reply being generated."""
    done = Signal(int, dict)
    """(request id, the ``done`` event: reason, new_tokens, tokens_per_s...)."""
    failed = Signal(int, str)
    """(request id, message): one request failed; the child carries on."""
    ended = Signal(str)
    """The child is gone: why, in words ("" when :meth:`close` ended it)."""

    def __init__(self, model_path: str, argv: list[str] | None = None, parent=None):
        super().__init__(parent)
        self.model_path = model_path
        self.argv = argv if argv is not None else chat_argv(model_path)
        self.info: dict | None = None
        self._next_id = 0
        self._out = b""
        self._err = b""
        self._fatal = ""
        self._closing = False
        self.proc = QProcess(self)
        env = QProcessEnvironment()
        for key, value in engine_env().items():
            env.insert(key, value)
        self.proc.setProcessEnvironment(env)
        self.proc.readyReadStandardOutput.connect(self._read_out)
        self.proc.readyReadStandardError.connect(self._read_err)
        self.proc.finished.connect(self._finished)
        self.proc.errorOccurred.connect(self._error)

    # ---- commands ----------------------------------------------------------------------------
    def start(self) -> None:
        self.proc.start(self.argv[0], self.argv[1:])

    @property
    def running(self) -> bool:
        return self.proc.state() != QProcess.ProcessState.NotRunning

    def generate(self, messages: list[dict], settings: dict) -> int:
        """Ask for a reply to ``messages``; returns the request id its signals carry."""
        self._next_id += 1
        self._send({"op": "generate", "id": self._next_id, "messages": messages,
                    "settings": settings})
        return self._next_id

    def stop(self, request_id: int) -> None:
        self._send({"op": "stop", "id": request_id})

    def close(self) -> None:
        """Ask the child to quit, and kill it if it has not after a moment."""
        if not self.running:
            return
        self._closing = True
        self._send({"op": "quit"})
        self.proc.closeWriteChannel()
        if not self.proc.waitForFinished(1500):
            self.proc.kill()
            self.proc.waitForFinished(1500)

    def _send(self, request: dict) -> None:
        if self.running:
            self.proc.write((json.dumps(request) + "\n").encode())

    # ---- the child's output ------------------------------------------------------------------
    def _read_out(self) -> None:
        lines = (self._out + bytes(self.proc.readAllStandardOutput())).split(b"\n")
        self._out = lines.pop()
        for line in lines:
            if line.strip():
                self._dispatch(line)

    def _dispatch(self, line: bytes) -> None:
        try:
            ev = json.loads(line)
        except ValueError:
            return  # not a protocol line (a library printing to stdout): ignore it
        kind = ev.get("event")
        if kind == "ready":
            self.info = ev
            self.ready.emit(ev)
        elif kind == "token":
            self.token.emit(int(ev["id"]), str(ev["text"]))
        elif kind == "done":
            self.done.emit(int(ev["id"]), ev)
        elif kind == "error" and ev.get("fatal"):
            self._fatal = str(ev.get("message", ""))
        elif kind == "error":
            self.failed.emit(int(ev.get("id") or 0), str(ev.get("message", "")))

    def _read_err(self) -> None:
        self._err = (self._err + bytes(self.proc.readAllStandardError()))[-STDERR_KEEP:]

    def _finished(self, code: int, status) -> None:
        self._read_out()
        if self._closing:
            self.ended.emit("")
            return
        log = self._err.decode("utf-8", errors="replace").strip()
        words = ("The chat engine process was killed or crashed."
                 if status == QProcess.ExitStatus.CrashExit else exit_words(code))
        last = log.splitlines()[-1] if log else ""
        self.ended.emit(self._fatal or last_error(log) or f"{words} {last}".strip())

    def _error(self, error) -> None:
        if error == QProcess.ProcessError.FailedToStart:
            self.ended.emit(f"The chat engine could not be started: {self.proc.errorString()}")
