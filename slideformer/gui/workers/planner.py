"""The planner in a process of its own, so the GUI thread never waits for it (nor for a scan
of the models on this machine, which plans each of them).

The planner is pure Python. Run on a thread of the app's own process it holds the GIL for
milliseconds at a time, over and over, and the GUI thread waits its turn each time it has
anything to do: the 10 ms latency probe of tests/gui/pages/test_plan_page.py was late by 40-70 ms
while an 8B model was planned 100 times on a thread (2-core machine), and by 150-165 ms while
120 models found on the machine were planned (the scan itself took 9 s instead of 2.4 s). So one
child process, started on first use and shared by every page, answers requests (a plan, a scan)
one at a time over a pipe, at a lower CPU priority than the app.

Requests are queued for one long-lived thread that waits for the answers (blocked in a read,
without the GIL): starting a thread per request made the GUI thread wait until the OS ran the
new one, up to 14 ms on a busy machine.
"""
from __future__ import annotations

import multiprocessing
import queue
import sys
import threading

import psutil
from PySide6.QtCore import QObject, Signal

from slideformer.engine.api import HardwareProfile, Plan, RunConfig, UserError, override, plan_for_config
from slideformer.gui.workers.thread import TaskError


def plan_for(model_path: str, settings: dict, hardware: HardwareProfile) -> Plan:
    """The planner's answer for a model folder and run-config settings (``{"train.micro_batch":
    4, ...}``), at the speeds of ``hardware``."""
    return plan_for_config(override(RunConfig(), {"model.path": model_path, **settings}), hardware)


def _lower_priority() -> None:
    """Let the app's GUI thread go first when the CPU is busy (the planner can wait a frame)."""
    me = psutil.Process()
    me.nice(psutil.BELOW_NORMAL_PRIORITY_CLASS if sys.platform == "win32" else 10)


def _serve(conn) -> None:
    """The child process: answer ``(function, args)`` requests (an engine function, pickled by
    reference) until the pipe closes, each with ``(True, its value)`` or ``(False, message for
    people)``."""
    _lower_priority()
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the app went away
            return
        try:
            answer = (True, fn(*args))
        except UserError as e:
            answer = (False, str(e))
        except Exception as e:  # noqa: BLE001 - shown to the user, not swallowed
            answer = (False, f"{type(e).__name__}: {e}")
        conn.send(answer)


class PlanReplies(QObject):
    """Where the answers to one page's requests arrive (in the GUI thread)."""

    planned = Signal(object)
    """The :class:`~slideformer.engine.plan.Plan` asked for."""
    failed = Signal(str)
    """Why there is none, in words for people."""


class PlannerProcess:
    """A child process that plans: :meth:`ask` from the GUI thread (it never waits), or
    :meth:`plan` from any other thread (it waits for the answer)."""

    def __init__(self):
        self._lock = threading.Lock()
        """One request at a time on the pipe."""
        self._conn = None
        self._proc = None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._answering: threading.Thread | None = None

    def start(self) -> None:
        """Start the process (it imports the engine, a second or two) and the thread that
        answers :meth:`ask`, if they are not running; cheap when they are."""
        if self._answering is None:
            self._answering = threading.Thread(target=self._answer, name="plan-requests",
                                               daemon=True)
            self._answering.start()
        if self._lock.acquire(blocking=False):  # never wait: a request has started it then
            try:
                self._ensure()
            finally:
                self._lock.release()

    def ask(self, replies: PlanReplies, model_path: str, settings: dict,
            hardware: HardwareProfile) -> None:
        """Plan in the background; ``replies.planned`` or ``replies.failed`` follows. Call
        :meth:`start` once first."""
        self._requests.put((replies, (model_path, settings, hardware)))

    def _answer(self) -> None:
        while True:
            replies, request = self._requests.get()
            try:
                plan = self.plan(*request)
            except TaskError as e:
                replies.failed.emit(str(e))
            else:
                replies.planned.emit(plan)

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            return
        ctx = multiprocessing.get_context("spawn")  # no fork of a process running Qt threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child,), name="slideformer-planner",
                                 daemon=True)
        self._proc.start()
        child.close()

    def plan(self, model_path: str, settings: dict, hardware: HardwareProfile) -> Plan:
        """The plan (see :func:`plan_for`), computed in the child process.

        Raises:
            TaskError: the planner's message for bad settings, or the process stopped (the next
                request starts a new one).
        """
        return self.call(plan_for, model_path, settings, hardware)

    def call(self, fn, *args):
        """``fn(*args)`` computed in the child process (``fn``: a module-level engine function,
        its arguments and value picklable). Raises as :meth:`plan` does."""
        with self._lock:
            self._ensure()
            try:
                self._conn.send((fn, args))
                ok, value = self._conn.recv()
            except (EOFError, OSError):
                code = self._proc.exitcode
                self._proc = None
                raise TaskError(f"The planner process stopped (exit code {code}); the next "
                                f"change starts it again.") from None
        if not ok:
            raise TaskError(value)
        return value


_shared = PlannerProcess()


def shared_planner() -> PlannerProcess:
    """The app's planner process (one for all pages; it keeps no state between requests)."""
    return _shared
