"""One owner per run folder: an OS file lock on ``<run dir>/lock`` that dies with its process.

The training process holds an exclusive, non-blocking lock on the file for as long as it runs
(``flock`` on POSIX, ``msvcrt.locking`` on Windows). The operating system drops the lock when
the process ends in any way (exit, crash, ``kill -9``), so a stale lock cannot outlive its
owner and there is nothing to clean up. The file also names the owner's pid, for messages.

:func:`run_owner` asks without taking the lock for long: it tries to lock the file and lets go
at once, so front ends (the desktop app) can check a folder before they start or resume a run.
"""
from __future__ import annotations

import os
from pathlib import Path

from slideformer.engine.errors import UserError

LOCK_FILE = "lock"

try:
    import fcntl
except ImportError:  # Windows
    fcntl = None
    import msvcrt


def _try_lock(fd: int) -> bool:
    try:
        if fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        else:
            os.lseek(fd, 0, os.SEEK_SET)
            msvcrt.locking(fd, msvcrt.LK_NBLCK, 1)
    except OSError:
        return False
    return True


def _unlock(fd: int) -> None:
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_UN)
    else:
        os.lseek(fd, 0, os.SEEK_SET)
        msvcrt.locking(fd, msvcrt.LK_UNLCK, 1)


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def run_owner(run_dir: Path | str) -> int | None:
    """The pid of the live process that holds ``run_dir``'s lock (0 if it cannot be read), or
    None when no process holds it."""
    path = Path(run_dir) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return None  # no lock file: no run ever took this folder (or it is not ours to lock)
    try:
        if _try_lock(fd):
            _unlock(fd)
            return None
        return _pid_in(path) or 0
    finally:
        os.close(fd)


class RunLock:
    """The lock of one run folder, held by this process until :meth:`release`."""

    def __init__(self, run_dir: Path | str):
        self.path = Path(run_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock, or raise a UserError naming the process that holds it."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        if not _try_lock(fd):
            os.close(fd)
            pid = _pid_in(self.path)
            who = f"process {pid}" if pid else "another process"
            raise UserError(self.path.parent, f"is being trained by {who} right now",
                            "wait for that run to end (or stop it: Stop in the app, Ctrl-C in "
                            "its terminal), then resume; or choose another output.run_dir")
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, f"{os.getpid()}\n".encode("ascii"))
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            try:
                _unlock(self._fd)
            finally:
                os.close(self._fd)
                self._fd = None
