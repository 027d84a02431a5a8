"""A training run seen from outside its process: start it, follow its events, steer it.

A run folder (``output.run_dir``) is the whole interface between a front end and the engine
process training it: the engine appends every event to ``events.jsonl`` and reads commands from
the ``control`` file (:mod:`slideformer.engine.train.control`). :class:`RunClient` wraps both, so the desktop
app, a script or a test steer a run the same way, whether they started it (``start``) or it was
started elsewhere (a terminal ``slideformer train``): ``follow`` works on either.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

from slideformer.engine.events import RunState, from_json, read_events
from slideformer.engine.train.control import engine_alive, send_command
from slideformer.engine.train.lock import run_owner

EVENTS_FILE, CONFIG_FILE, LOG_FILE = "events.jsonl", "config.toml", "engine.log"
"""``LOG_FILE``: the console output (stdout and stderr) of an engine process a client started."""
TERMINAL_STATES = ("finished", "stopped", "failed")
ALIVE_CHECK_S = 1.0
"""How often ``follow`` checks that a run started elsewhere still has a live engine."""
_ROOT = Path(__file__).resolve().parents[2]
"""The folder that holds the ``engine`` package (put on a child's PYTHONPATH)."""


def engine_command(*args: str) -> list[str]:
    """The argv that runs ``slideformer ARGS`` with this Python (or this desktop bundle)."""
    if getattr(sys, "frozen", False):  # a bundled app: its executable is the CLI
        return [sys.executable, *args]
    return [sys.executable, "-m", "slideformer.engine.cli", *args]


def train_argv(config: Path | str, resume: bool = False) -> list[str]:
    """The engine command line that trains from ``config`` (what a terminal user would type)."""
    return engine_command("train", "--config", str(config), *(["--resume"] if resume else []))


def engine_env() -> dict[str, str]:
    """The environment of an engine process: this one, with the engine importable from it."""
    env = dict(os.environ)
    if not getattr(sys, "frozen", False):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_ROOT), env.get("PYTHONPATH")) if p)
    return env


class EventReader:
    """Reads the events appended to an ``events.jsonl`` since the previous call.

    Only complete lines are consumed: a line the engine is still writing is read next time.
    A missing file is not an error (the engine has not created it yet).
    """

    def __init__(self, path: Path | str):
        self.path = Path(path)
        self.offset = 0
        self._partial = b""

    def read_new(self) -> list:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        return [from_json(line.decode("utf-8")) for line in lines if line.strip()]


class RunClient:
    """One run folder, from outside the process that trains it.

    Args:
        run_dir: the run folder (``output.run_dir`` of the run's config).
    """

    def __init__(self, run_dir: Path | str):
        self.run_dir = Path(run_dir)
        self.process: subprocess.Popen | None = None
        """The engine process this client started (None for a run started elsewhere)."""
        self._reader = EventReader(self.events_path)

    @property
    def events_path(self) -> Path:
        return self.run_dir / EVENTS_FILE

    @property
    def log_path(self) -> Path:
        return self.run_dir / LOG_FILE

    # ---- starting ------------------------------------------------------------------------------
    def start(self, config: Path | str, resume: bool = False) -> subprocess.Popen:
        """Start ``slideformer train --config CONFIG [--resume]`` in a process of its own."""
        return self.spawn(train_argv(config, resume))

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        """Start the engine command ``argv``; its console output goes to ``engine.log``.

        Raises:
            OSError: the process could not be started.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Its own session: the engine outlives the app when the user keeps it training in the
        # background, and a Ctrl-C meant for the app's terminal does not reach it.
        detach = ({"start_new_session": True} if os.name == "posix" else
                  {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP})
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, env=engine_env(), **detach)
        return self.process

    # ---- steering (the control file) -----------------------------------------------------------
    def send(self, command: str) -> None:
        """``pause``, ``resume``, ``stop`` (after this step, and save) or ``abort`` (save nothing).

        Raises:
            OSError: the run folder is gone or read-only.
        """
        send_command(self.run_dir, command)

    def pause(self) -> None:
        self.send("pause")

    def resume(self) -> None:
        self.send("resume")

    def stop(self, save: bool = True) -> None:
        """Stop after the current step; ``save`` writes a checkpoint and the final model."""
        self.send("stop" if save else "abort")

    # ---- reading -------------------------------------------------------------------------------
    def alive(self) -> int | None:
        """The pid of the live process training this run (0 if its lock names none), or None.

        The folder's lock (slideformer.engine.train.lock) is held from before the engine's first event to
        its exit; the liveness mark covers an engine that predates the lock.
        """
        owner = run_owner(self.run_dir)
        return owner if owner is not None else engine_alive(self.run_dir)

    def events(self) -> list:
        """Every complete event of the run so far ([] before the engine wrote one)."""
        return read_events(self.events_path) if self.events_path.is_file() else []

    def read_new(self) -> list:
        """The events written since the previous ``read_new`` or ``follow`` (all, the first time)."""
        return self._reader.read_new()

    def state(self) -> RunState | None:
        """The run's latest state change, or None before its first."""
        states = [ev for ev in self.events() if isinstance(ev, RunState)]
        return states[-1] if states else None

    def follow(self, poll_s: float = 0.1, timeout: float | None = None) -> Iterator:
        """Yield the run's events as they are written, until it ends.

        A run this client started has ended when its process exits. A run started elsewhere has
        ended when its last state is final (finished, stopped, failed) and no process trains it,
        or when, after its first event, no live engine was seen for two checks
        :data:`ALIVE_CHECK_S` apart (the engine writes its liveness mark just after its first
        event). A folder with no events yet is waited on: its engine may still be starting.

        Raises:
            TimeoutError: ``timeout`` seconds passed before the run ended.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        last, seen, misses, next_check = None, False, 0, 0.0
        while True:
            for ev in self.read_new():
                seen = True
                last = ev.state if isinstance(ev, RunState) else last
                yield ev
            if self.process is not None:
                ended = self.process.poll() is not None
            elif seen and time.monotonic() >= next_check:
                next_check = time.monotonic() + ALIVE_CHECK_S
                misses = 0 if self.alive() is not None else misses + 1
                ended = misses >= (1 if last in TERMINAL_STATES else 2)
            else:
                ended = False
            if ended:
                yield from self.read_new()
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{self.run_dir}: the run did not end in {timeout:.0f} s")
            time.sleep(poll_s)
