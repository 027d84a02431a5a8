"""Running hostile corpus cases as processes: forked from a warm interpreter
(``forked_cli.py``), or through ``python -m slideformer.cli`` itself; and the tally of outcomes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hostile_corpus import TIMEOUT, Case, check_outcome, prepare_case

ROOT = Path(__file__).resolve().parents[2]
SERVER = Path(__file__).with_name("forked_cli.py")


@dataclass(frozen=True)
class Outcome:
    """How one case ended."""

    case: Case
    code: int | None
    """Exit code (negative: killed by that signal); None: a hang, killed after the timeout."""
    out: str
    err: str
    seconds: float

    def verdict(self) -> str:
        """``handled``, ``hang``, ``traceback``, or ``wrong: <why>`` (exit code or words)."""
        if self.code is None:
            return "hang"
        if "Traceback" in self.err:
            return "traceback"
        try:
            check_outcome(self.case, self.code, self.out, self.err)
        except AssertionError as e:
            return f"wrong: {str(e)[:300]}"
        return "handled"


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _text(raw: bytes) -> str:
    return raw.decode(errors="backslashreplace")


def run_forked(cases: list[Case], pristine: Path, root: Path, workers: int,
               timeout: float = TIMEOUT) -> tuple[list[Outcome], float]:
    """Every case in a child of one warm interpreter, ``workers`` at a time.

    Returns the outcomes (in the order of ``cases``) and the seconds the interpreter took to
    import the command line (paid once instead of once per case)."""
    requests = []
    for i, case in enumerate(cases):
        w = root / f"case-{i}"
        requests.append({"id": i, "args": list(case.args), "cwd": str(w),
                         "env": prepare_case(case, pristine, w),
                         "stdout": str(root / f"case-{i}.out"),
                         "stderr": str(root / f"case-{i}.err")})
    p = subprocess.run([sys.executable, str(SERVER), "--workers", str(workers), "--timeout",
                        str(timeout)], input="".join(json.dumps(r) + "\n" for r in requests),
                       capture_output=True, text=True, env=_env(),
                       timeout=120 + timeout * len(cases))  # each child is killed at `timeout`
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in p.stdout.splitlines()]
    warm = next(x["ready"] for x in lines if "ready" in x)
    ended = {x["id"]: x for x in lines if "id" in x}
    assert len(ended) == len(cases), p.stderr[-3000:]
    outcomes = []
    for i, case in enumerate(cases):
        r = ended[i]
        outcomes.append(Outcome(case, None if r["hang"] else r["code"],
                                _text(Path(requests[i]["stdout"]).read_bytes()),
                                _text(Path(requests[i]["stderr"]).read_bytes()), r["seconds"]))
    return outcomes, warm


def run_subprocess(case: Case, w: Path, env_changes: dict,
                   timeout: float = TIMEOUT) -> Outcome:
    """``python -m slideformer.cli`` in ``w``, as a user runs it."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "slideformer.cli", *case.args], cwd=w,
                           env=dict(_env(), **env_changes), capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        return Outcome(case, None, _text(e.stdout or b""), _text(e.stderr or b""), timeout)
    return Outcome(case, p.returncode, _text(p.stdout), _text(p.stderr), time.perf_counter() - t0)


def run_subprocesses(cases: list[Case], pristine: Path, root: Path,
                     workers: int) -> list[Outcome]:
    """Each case through :func:`run_subprocess`, ``workers`` at a time."""
    def one(i: int) -> Outcome:
        w = root / f"entry-{i}"
        return run_subprocess(cases[i], w, prepare_case(cases[i], pristine, w))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, range(len(cases))))


def summary(outcomes: list[Outcome], categories: int, wall: float, workers: int,
            warm: float) -> str:
    """One line: cases tried, handled, tracebacks, hangs, other failures, time per case."""
    verdicts = [o.verdict() for o in outcomes]
    secs = [o.seconds for o in outcomes]
    slowest = max(outcomes, key=lambda o: o.seconds)
    return (f"hostile corpus: {len(outcomes)} cases tried ({categories} categories), "
            f"{verdicts.count('handled')} handled, {verdicts.count('traceback')} tracebacks, "
            f"{verdicts.count('hang')} hangs, "
            f"{sum(v.startswith('wrong') for v in verdicts)} wrong exit code or message; "
            f"per case mean {sum(secs) / len(secs):.2f} s, max {max(secs):.2f} s "
            f"({slowest.case.name}); {wall:.0f} s in all, {workers} at a time, after "
            f"{warm:.1f} s importing the command line once")
