"""The engine bridge: one training run, in an engine process of its own, seen through Qt signals.

The app runs ``slideformer train --config FILE [--resume]`` as a child process -- the same
command and config file a terminal user would use -- and an :class:`EngineBridge` (a QThread)
owns it: it starts the process, follows ``<run dir>/events.jsonl`` (every event the engine
reports) and hands new events to the GUI thread as :attr:`EngineBridge.events` batches. Commands
go the other way through the run folder's control file (:class:`slideformer.engine.api.RunClient`), written
by the bridge's thread, so the GUI thread never waits on a file or a process.

A bridge can also *follow* a run it did not start (a terminal run, or one left training in the
background): the same file is followed, the same commands work, and the bridge notices when the
process running it goes away.

An engine that dies -- an exception, ``kill -9``, out of memory -- ends the bridge with
``outcome = "failed"``, the reason in words and the tail of its log; the run folder keeps its
last checkpoint, so ``--resume`` continues from there.
"""
from __future__ import annotations

import queue
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from PySide6.QtCore import QThread, Signal

from slideformer.engine.api import EventReader, RunClient, RunState, train_argv
from slideformer.gui.models.runs import TERMINAL_STATES, engine_log, text_tail

POLL_S = 0.1
"""How often the bridge looks for new events (the plots repaint at 15 Hz anyway)."""
ALIVE_CHECK_S = 1.0
"""How often a followed run's process is checked; it counts as gone after two misses in a row
(a run in its first second may not have written its liveness mark yet)."""
LOG_LINES = 15


@dataclass(frozen=True)
class RunEnd:
    """How the bridge's run ended, as shown to the user."""

    outcome: str
    """finished, stopped, failed, interrupted (a followed run's process vanished) or detached."""
    message: str
    log_tail: str = ""
    """The last lines of the engine's log, for failures."""


launch_argv = train_argv
"""The engine command line that trains from a config (what the CLI command shows)."""


class EngineBridge(QThread):
    """Starts (or follows) one run and reports its events until it ends.

    Args:
        run_dir: the run folder (``output.run_dir`` of the config); an engine the bridge
            starts writes its console output (stdout and stderr) to ``engine.log`` there.
        argv: the engine command to start, or None to follow a run some other process runs.
    """

    events = Signal(list)
    """New events from ``events.jsonl``, oldest first (the whole history first, when a bridge
    starts on an existing run)."""
    ended = Signal(object)
    """The run ended or the bridge stopped following it: a :class:`RunEnd`."""

    def __init__(self, run_dir: Path | str, argv: list[str] | None = None, parent=None):
        super().__init__(parent)
        self.run_dir = Path(run_dir)
        self.client = RunClient(run_dir)
        self.argv = argv
        self.owned = argv is not None
        self.pid: int | None = None
        self._commands: queue.Queue[str] = queue.Queue()

    # ---- commands (GUI thread; carried out by the bridge's thread) ---------------------------
    def pause(self) -> None:
        self._commands.put("pause")

    def resume(self) -> None:
        self._commands.put("resume")

    def stop_and_save(self) -> None:
        """Stop after the current step, save a checkpoint and the final model."""
        self._commands.put("stop")

    def abort(self) -> None:
        """End the run now without saving (an owned process is killed; the last checkpoint
        stays); a followed run stops after its current step without saving."""
        self._commands.put("abort")

    def detach(self) -> None:
        """Stop following; the engine process carries on by itself."""
        self._commands.put("detach")

    # ---- the bridge's thread -----------------------------------------------------------------
    def run(self) -> None:
        proc = None
        if self.owned:
            try:
                proc = self._spawn()
            except OSError as e:
                self.ended.emit(RunEnd("failed", f"The engine could not be started: {e}"))
                return
        reader = EventReader(self.client.events_path)
        last: RunState | None = None
        got_events = False
        misses, next_check = 0, 0.0
        while True:
            command = self._next_command()
            if command == "detach":
                self._flush(reader)
                self.ended.emit(RunEnd("detached", "The engine carries on in the background."))
                return
            if command is not None:
                self._carry_out(command, proc)
            news = reader.read_new()
            if news:
                got_events = True
                states = [ev for ev in news if isinstance(ev, RunState)]
                last = states[-1] if states else last
                self.events.emit(news)
            if proc is not None:
                rc = proc.poll()
                if rc is not None:
                    self._flush(reader)
                    self.ended.emit(self._owned_end(rc, last, got_events))
                    return
            elif time.monotonic() >= next_check:
                next_check = time.monotonic() + ALIVE_CHECK_S
                misses = 0 if self.client.alive() is not None else misses + 1
                if misses >= (1 if last is not None and last.state in TERMINAL_STATES else 2):
                    self._flush(reader)
                    self.ended.emit(self._followed_end(last))
                    return

    def _next_command(self) -> str | None:
        try:
            return self._commands.get(timeout=POLL_S)
        except queue.Empty:
            return None

    def _spawn(self) -> subprocess.Popen:
        proc = self.client.spawn(self.argv)
        self.pid = proc.pid
        return proc

    def _carry_out(self, command: str, proc: subprocess.Popen | None) -> None:
        if command == "abort" and proc is not None:
            proc.kill()
            return
        try:
            self.client.send(command)
        except OSError:
            pass  # the run folder is gone or read-only: the end of the process will tell

    def _flush(self, reader: EventReader) -> None:
        news = reader.read_new()
        if news:
            self.events.emit(news)

    def _owned_end(self, rc: int, last: RunState | None, got_events: bool) -> RunEnd:
        if rc == 0 and last is not None and last.state in ("finished", "stopped"):
            return RunEnd(last.state, last.message)
        log = text_tail(engine_log(self.run_dir), LOG_LINES)
        if not got_events:  # it failed before taking the run folder (a config error...)
            return RunEnd("failed", last_error(log) or exit_words(rc), log)
        if last is not None and last.state == "failed":
            return RunEnd("failed", last.message, log)
        return RunEnd("failed", exit_words(rc), log)

    def _followed_end(self, last: RunState | None) -> RunEnd:
        if last is not None and last.state in TERMINAL_STATES:
            return RunEnd(last.state, last.message,
                          text_tail(engine_log(self.run_dir), LOG_LINES)
                          if last.state == "failed" else "")
        return RunEnd("interrupted", "The engine process running this run has ended without "
                                     "saving (it was killed or crashed).",
                      text_tail(engine_log(self.run_dir), LOG_LINES))


def last_error(log: str) -> str:
    """The CLI's own message ("error: ...") in a log tail, without the prefix."""
    lines = log.splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith("error: "):
            return "\n".join([lines[i].removeprefix("error: ")] + lines[i + 1:])
    return ""


def exit_words(rc: int) -> str:
    """An exit status in words: "killed by SIGKILL", "exited with code 1"."""
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"The engine process was killed by {name}."
    return f"The engine process exited with code {rc}."
