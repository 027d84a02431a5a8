"""Run one function off the GUI thread and get its result back as a signal.

``run_task(fn, *args, owner=widget, done=..., failed=...)`` connects the callbacks, then calls
``fn`` on a worker thread, and returns the :class:`Task` (a QObject living in the GUI thread).
The callbacks run only while ``owner`` (the page or dialog they update) still exists: a page
closed before its task ends is not called back into. The worker
never touches widgets: it only emits ``done(result)`` or ``failed(message)``, which Qt
delivers in the GUI thread. A :class:`~slideformer.engine.errors.UserError` or :class:`TaskError` becomes
its own message; any other exception one line naming its type.
"""
from __future__ import annotations

import threading

import shiboken6
from PySide6.QtCore import QObject, Signal

from slideformer.engine.api import UserError


class TaskError(Exception):
    """A failure whose message is already written for people (shown as it is)."""


# Tasks still running, so that a Task is not garbage-collected while its thread may emit.
_live: set["Task"] = set()


class Task(QObject):
    """Background work: exactly one of ``done`` / ``failed`` fires, then ``finished``."""

    done = Signal(object)
    failed = Signal(str)
    finished = Signal()

    def __init__(self, fn, args, name: str):
        super().__init__()
        self._fn, self._args = fn, args
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.finished.connect(self._forget)

    def _run(self) -> None:
        try:
            result = self._fn(*self._args)
        except (UserError, TaskError) as e:
            self._send(self.failed, str(e))
        except Exception as e:  # noqa: BLE001 - shown to the user, not swallowed
            self._send(self.failed, f"{type(e).__name__}: {e}")
        else:
            self._send(self.done, result)
        self._send(self.finished)
        if not shiboken6.isValid(self):  # no finished signal reached _forget
            _live.discard(self)

    def _send(self, signal, *args) -> None:
        """Emit, unless this task's C++ object is gone: the application closed (its objects
        deleted) while the worker still ran, and nobody is left to tell."""
        if not shiboken6.isValid(self):
            return
        try:
            signal.emit(*args)
        except RuntimeError:  # deleted between the check and the emit
            if shiboken6.isValid(self):
                raise

    def _forget(self) -> None:
        _live.discard(self)


def run_task(fn, *args, owner: QObject, done=None, failed=None, name: str = "task") -> Task:
    """Start ``fn(*args)`` on a worker thread.

    ``done(result)`` and ``failed(message)`` are connected before the thread starts, so a fast
    function cannot finish before anyone listens; they are skipped once ``owner``'s C++ object
    is gone (a lambda has no receiver for Qt to disconnect when it is destroyed).
    """
    task = Task(fn, args, name)
    for signal, callback in ((task.done, done), (task.failed, failed)):
        if callback is not None:
            signal.connect(_while_alive(owner, callback))
    _live.add(task)
    task._thread.start()
    return task


def _while_alive(owner: QObject, callback):
    def call(value) -> None:
        if shiboken6.isValid(owner):
            callback(value)
    return call
