"""Many ``slideformer`` command lines, each in a process of its own, without paying the
interpreter's start for each: a warm interpreter that forks.

``python -m slideformer.cli`` spends seconds importing torch before it does anything, and the
hostile corpus has over a hundred command lines. This script imports the command line once, then
forks one child per command line, at most ``--workers`` at a time. A child is a process like the
command's own: its exit code, its stdout and stderr (files), a fatal signal, and, past
``--timeout`` seconds, a kill that the report calls a hang. The server itself never runs a torch
operation, so no thread pool exists yet when it forks.

    python tests/hostile/forked_cli.py --workers 2 --timeout 60 < requests > results

Requests (stdin, one JSON object per line, read to the end before the first fork):
``{"id", "args", "cwd", "env", "stdout", "stderr"}``. Results (stdout, one line per finished
command, in the order they finish): ``{"id", "code", "seconds", "hang"}``; ``code`` is negative
for a signal, as in :mod:`subprocess`; first, ``{"ready": seconds}``, the time the imports took.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback

WARM = ("torch", "slideformer.engine.api", "slideformer.engine.train.trainer",
        "slideformer.engine.plan.planner", "slideformer.engine.data.prepare")
"""Modules the commands import in their handlers: imported once, before any fork."""


def _run_child(request: dict) -> None:
    """In the forked child: become the command (folder, environment, output files) and exit."""
    from slideformer.cli import main

    os.chdir(request["cwd"])
    os.environ.update(request["env"])
    for fd, key in ((1, "stdout"), (2, "stderr")):
        f = os.open(request[key], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        os.dup2(f, fd)
        os.close(f)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    code = 1
    try:
        code = main(request["args"])
    except SystemExit as e:  # what the interpreter does with it
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # an uncaught exception: the traceback the user would see
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)


def serve(requests: list[dict], workers: int, timeout: float, report) -> None:
    """Run every request, ``workers`` at a time; ``report(result)`` as each one ends."""
    pending, running = list(reversed(requests)), {}
    while pending or running:
        while pending and len(running) < workers:
            request = pending.pop()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _run_child(request)
            running[pid] = (request, time.monotonic(), False)
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            request, start, killed = running.pop(pid)
            report({"id": request["id"], "code": os.waitstatus_to_exitcode(status),
                    "seconds": time.monotonic() - start, "hang": killed})
            continue
        now = time.monotonic()
        for pid, (request, start, killed) in running.items():
            if not killed and now - start > timeout:
                os.kill(pid, signal.SIGKILL)
                running[pid] = (request, start, True)
        time.sleep(0.005)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    t0 = time.monotonic()
    for name in WARM:
        __import__(name)
    requests = [json.loads(line) for line in sys.stdin if line.strip()]

    def report(result: dict) -> None:
        print(json.dumps(result), flush=True)
    report({"ready": time.monotonic() - t0})
    serve(requests, a.workers, a.timeout, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
