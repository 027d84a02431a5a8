"""The whole hostile-input corpus through the real command line: ``python -m slideformer.engine.cli`` in a
subprocess per case, with a timeout (a hang is a failure). Prints cases tried / handled and the
time per case."""
from __future__ import annotations

import subprocess
import time

import pytest
from hostile_corpus import ALL, CATEGORIES, check_outcome, make_workspace, prepare_case, run_subprocess


@pytest.mark.slow
def test_whole_corpus_through_the_cli(tmp_path):
    pristine = make_workspace(tmp_path / "pristine")
    failures, times = [], []
    t0 = time.perf_counter()
    for i, case in enumerate(ALL):
        w = tmp_path / f"case-{i}"
        env = prepare_case(case, pristine, w)
        try:
            code, out, err, dt = run_subprocess(case, w, env)
            times.append(dt)
            check_outcome(case, code, out, err)
        except subprocess.TimeoutExpired:
            failures.append(f"{case.name}: no exit within the timeout (a hang)")
        except AssertionError as e:
            failures.append(f"{case.name}: {str(e)[:300]}")
    per = sorted(times)
    print(f"\nhostile corpus: {len(ALL)} cases tried in {len(CATEGORIES)} categories, "
          f"{len(ALL) - len(failures)} handled; {time.perf_counter() - t0:.0f} s in all; "
          f"per case median {per[len(per) // 2]:.1f} s, max {per[-1]:.1f} s")
    assert not failures, "\n".join(failures)
