"""The whole hostile-input corpus, each case in a process of its own with a timeout (a hang is a
failure), and the first case of each category through ``python -m slideformer.cli`` itself.

The cases run in children forked from one interpreter that has imported the command line
(corpus_processes.run_forked): the same ``main``, exit code, stdout and stderr as the command,
without paying torch's import once per case; as many at a time as the machine has cores. Prints
one line: cases tried, handled, tracebacks, hangs, the time per case.
"""
from __future__ import annotations

import os
import time

import pytest
from corpus_processes import run_forked, run_subprocesses, summary
from hostile_corpus import make_workspace
from hostile_folders import CORPUS


@pytest.mark.slow
def test_whole_corpus_a_process_per_case(tmp_path, capsys):
    pristine = make_workspace(tmp_path / "pristine")
    workers = os.cpu_count() or 1
    t0 = time.perf_counter()
    cases = [c for category in CORPUS.values() for c in category]
    outcomes, warm = run_forked(cases, pristine, tmp_path / "forked", workers)
    wall = time.perf_counter() - t0
    firsts = [category[0] for category in CORPUS.values()]
    t0 = time.perf_counter()
    entry = run_subprocesses(firsts, pristine, tmp_path / "entry", workers)
    entry_wall = time.perf_counter() - t0
    failures = [f"{o.case.name}: {v}" for o in outcomes + entry
                if (v := o.verdict()) != "handled"]
    with capsys.disabled():
        print(f"\n{summary(outcomes, len(CORPUS), wall, workers, warm)}")
        print(f"through python -m slideformer.cli: {len(entry)} cases, "
              f"{sum(o.verdict() == 'handled' for o in entry)} handled, {entry_wall:.0f} s in all, "
              f"per case max {max(o.seconds for o in entry):.1f} s")
    assert not failures, "\n".join(failures)
