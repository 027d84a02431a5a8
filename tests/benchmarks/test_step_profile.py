"""benchmarks/step_profile.py gaps runs on the CPU backend (tiny shape) and reports the step's
phases in order, the compute spans' gaps and the optimizer spans."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_dry_run_reports_phases_gaps_and_updates():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "gaps", "2"],
                         capture_output=True, text=True, check=True, cwd=ROOT, timeout=600).stdout
    row = json.loads(out.strip().splitlines()[-1])
    assert row["tok_s"] > 0 and row["compute_busy_s"] > 0
    names = [n for n, _ in row["phases"]]
    assert names == ["forward_window>", "forward_window<", "head_step>", "head_step<",
                     "backward_window>", "backward_window<", "_barrier_updates>", "_barrier_updates<"]
    times = [t for _, t in row["phases"]]
    assert times == sorted(times)
    assert {o[0] for o in row["optimizer"]} >= {"layer0", "embed", "head"}
    assert all(g[0] > 0 for g in row["gaps"]) and row["head_ms"]
