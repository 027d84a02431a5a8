"""Run a ``slideformer`` command in a child process, as a terminal user would.

Work that holds Python's GIL for long stretches (training a tokenizer, writing weights) would
stall the GUI thread if it ran on a thread of the app's own process, so the app runs it as the
same CLI command a terminal user types: headless parity for free, and a message for people
(the CLI's ``error: ...`` line) when it fails. Call :func:`run_engine_command` from a worker
thread (:func:`slideformer.gui.workers.thread.run_task`), never from the GUI thread.
"""
from __future__ import annotations

import subprocess

from slideformer.engine.api import engine_command
from slideformer.gui.workers.thread import TaskError


def run_engine_command(*args: str, timeout: float = 600.0) -> str:
    """Run ``slideformer ARGS`` and return what it printed.

    Raises:
        TaskError: the command failed; the message is its own error text.
    """
    try:
        done = subprocess.run(engine_command(*args), capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise TaskError(f"`slideformer {' '.join(args)}` did not finish in {timeout:.0f} s") \
            from None
    if done.returncode != 0:
        text = done.stderr.strip() or done.stdout.strip() or f"exit code {done.returncode}"
        raise TaskError(text.removeprefix("error: "))
    return done.stdout
