"""Talking to a training process from outside it, through its run folder's ``control`` file.

Any front end can control any run, whoever started it (the desktop app, or ``slideformer train``
in a terminal):

- Commands are appended to ``<run dir>/control`` one per line by :func:`send_command`:
  ``pause``, ``resume``, ``stop`` (stop after this step and save) and ``abort`` (stop after this
  step, save nothing). The engine reads new lines on a thread of its own every :data:`POLL_S`
  seconds and calls the Trainer's ``pause()`` / ``resume()`` / ``stop(save)``, which take
  effect between steps.
- The file's first line names the process that reads it (``# engine pid=... started=...``); the
  engine writes it when the run starts and removes the file when the run ends. A process killed
  outright (``kill -9``, power loss) leaves it behind naming a process that no longer runs:
  :func:`engine_alive` tells the two apart.
- A failure that escapes the Trainer is reported as a ``RunState("failed")`` event with the
  error's message, so front ends following ``events.jsonl`` see why the run ended.

Nothing is written before the Trainer has accepted the run folder (its first event): a folder it
rejects belongs to another run.
"""
from __future__ import annotations

import re
import threading
from contextlib import contextmanager
from pathlib import Path

import psutil

from slideformer.engine.errors import UserError
from slideformer.engine.events import RunState

COMMANDS = ("pause", "resume", "stop", "abort")
CONTROL_FILE = "control"
POLL_S = 0.1
"""How often the engine looks for new commands; a command waits at most this long (plus the
rest of the current step)."""
_HEADER = re.compile(r"# engine pid=(\d+) started=([0-9.]+)")


def send_command(run_dir: Path | str, command: str) -> None:
    """Ask the process running ``run_dir`` to pause, resume, stop (and save) or abort."""
    if command not in COMMANDS:
        raise ValueError(f"command must be one of {COMMANDS}, not {command!r}")
    with open(Path(run_dir) / CONTROL_FILE, "a", encoding="utf-8") as f:
        f.write(command + "\n")


def engine_alive(run_dir: Path | str) -> int | None:
    """The pid of the live process running ``run_dir``, or None when no process runs it."""
    try:
        with open(Path(run_dir) / CONTROL_FILE, encoding="utf-8") as f:
            found = _HEADER.match(f.readline())
        if found is None:
            return None
        proc = psutil.Process(int(found.group(1)))
        # A pid can be reused by an unrelated process after a crash: the start time tells.
        if abs(proc.create_time() - float(found.group(2))) > 1.0:
            return None
        return proc.pid if proc.status() != psutil.STATUS_ZOMBIE else None
    except (OSError, ValueError, psutil.Error):
        return None


class RunControl:
    """The outside-facing side of one training process: the command reader and its mark.

    Use as ``Trainer(cfg, callbacks=[..., control.on_event])`` and run the trainer inside
    ``with control.attached(trainer):``.
    """

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir) / CONTROL_FILE
        self._trainer = None
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def attached(self, trainer):
        """Serve ``trainer`` while the block runs; a failure becomes a "failed" event."""
        self._trainer = trainer
        try:
            yield self
        except BaseException as e:
            self._failed(e)
            raise
        finally:
            self._close()

    def on_event(self, ev) -> None:
        """Trainer callback: its first event means the run folder is this run's."""
        if not self._started and self._trainer is not None:
            self._started = True
            me = psutil.Process()
            header = f"# engine pid={me.pid} started={me.create_time():.3f}\n"
            self.path.write_text(header, encoding="utf-8")  # drops commands for an older process
            self._thread = threading.Thread(target=self._read_commands, args=(len(header),),
                                            name="run-control", daemon=True)
            self._thread.start()

    def _failed(self, e: BaseException) -> None:
        sink = getattr(self._trainer, "sink", None)
        if not self._started or sink is None:
            return  # the folder was never accepted: nothing of ours to report into
        aborted = isinstance(e, KeyboardInterrupt)
        message = "aborted without saving" if aborted else (
            str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}")
        try:
            sink.emit(RunState("stopped" if aborted else "failed", message,
                               getattr(self._trainer, "step", 0)))
        except Exception:  # noqa: BLE001 - e.g. a closed console; the original error wins
            pass

    def _close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None
        if self._started:
            self.path.unlink(missing_ok=True)

    # ---- the command reader thread -------------------------------------------------------------
    def _read_commands(self, offset: int) -> None:
        partial = ""
        while not self._stop.wait(POLL_S):
            try:
                with open(self.path, encoding="utf-8") as f:
                    f.seek(offset)
                    text = f.read()
                    offset = f.tell()
            except FileNotFoundError:
                continue
            lines = (partial + text).split("\n")
            partial = lines.pop()  # a line still being written
            for line in lines:
                self._apply(line.strip())

    def _apply(self, command: str) -> None:
        t = self._trainer
        if command == "pause":
            t.pause()
        elif command == "resume":
            t.resume()
        elif command in ("stop", "abort"):
            t.stop(save=command == "stop")
