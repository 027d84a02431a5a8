"""A run folder has one owner, and resume means what it says.

- The lock (slideformer.engine.train.lock) is held by one process at a time and dies with it: checked with a
  second process, and with the real ``slideformer train --resume`` against a folder that is
  still training.
- A finished run says so when resumed; extending it with ``--max-steps`` continues from its
  final state: the extended run equals, bitwise, one uninterrupted run of the longer length.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from slideformer.engine.errors import UserError
from slideformer.engine.events import Log, RunState, StepMetrics
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.lock import RunLock, run_owner
from test_reliability import (_events_count, _start, _wait_for, _write_cfg, assert_same_run,
                              base, checkpoint_dirs, events_of, reference, run_cfg)

__all__ = ["base", "reference", "run_cfg"]  # module fixtures shared with test_reliability


def _holder(run_dir: Path) -> subprocess.Popen:
    """A child process that takes ``run_dir``'s lock, says so, and sleeps."""
    code = textwrap.dedent(f"""
        import sys, time
        from slideformer.engine.train.lock import RunLock
        RunLock({str(run_dir)!r}).acquire()
        print("held", flush=True)
        time.sleep(600)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_lock_has_one_owner_and_dies_with_its_process(tmp_path):
    assert run_owner(tmp_path) is None  # no lock file yet
    p = _holder(tmp_path)
    try:
        assert run_owner(tmp_path) == p.pid
        with pytest.raises(UserError) as e:
            RunLock(tmp_path).acquire()
        assert f"is being trained by process {p.pid}" in e.value.problem
    finally:
        p.kill()
        p.wait()
    assert run_owner(tmp_path) is None  # kill -9 left the file, not the lock
    mine = RunLock(tmp_path).acquire()
    try:
        assert run_owner(tmp_path) is not None  # held by this process now
    finally:
        mine.release()
    assert run_owner(tmp_path) is None


def test_resume_of_a_folder_still_training_is_refused(base, run_cfg):
    path, run = _write_cfg(base, run_cfg("owned", train__max_steps=10_000, train__save_every=1))
    first = _start(path)
    try:
        _wait_for(first, lambda: _events_count(run, StepMetrics) >= 2 and checkpoint_dirs(run))
        second = _start(path, "--resume")
        out, err = second.communicate(timeout=120)
        assert second.returncode == 2, (out, err)
        assert f"is being trained by process {first.pid} right now" in err
        assert "Traceback" not in err
        # The refused process wrote nothing into the folder: one setup, one engine.
        assert [e.state for e in events_of(run, RunState)].count("setup") == 1
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)
    assert first.returncode == 0 and run_owner(run) is None


def test_resuming_a_finished_run_says_it_is_finished(run_cfg, reference):
    run = reference()
    cfg = run_cfg(run.name)
    with pytest.raises(UserError) as e:
        run_training(cfg, resume=True)
    assert "has finished" in e.value.problem and "--max-steps" in e.value.fix


def test_extending_a_finished_run_continues_from_its_final_state(run_cfg, reference):
    """6 steps, then --max-steps 9 on the same folder == 9 steps in one go (constant LR, so the
    schedule of the first 6 steps does not depend on the total)."""
    steps, more = 6, 9
    over = dict(optim__schedule="constant", train__save_every=4)
    cfg = run_cfg("extend", train__max_steps=steps, **over)
    assert run_training(cfg) == "finished"
    run = Path(cfg.output.run_dir)
    assert max(checkpoint_dirs(run)) == steps  # saved at the end, not only at step 4
    offset = len(events_of(run, object))
    assert run_training(run_cfg("extend", train__max_steps=more, **over),
                        resume=True) == "finished"
    logs = [e.message for e in events_of(run, Log, offset)]
    assert f"resumed from step-{steps}" in logs
    assert [e.step for e in events_of(run, StepMetrics, offset)] == list(range(steps + 1, more + 1))
    assert_same_run(run, reference(train__max_steps=more, **over))


def test_a_finished_run_whose_export_failed_resumes_to_write_it(run_cfg, reference, monkeypatch):
    import errno
    import os
    from test_reliability import final_weights
    cfg = run_cfg("export-again")
    run = Path(cfg.output.run_dir)

    def no_space(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr("safetensors.torch.save_file", no_space)
        assert run_training(cfg) == "failed"  # every step done, the final model not written
    offset = len(events_of(run, object))
    assert run_training(cfg, resume=True) == "finished"
    assert not events_of(run, StepMetrics, offset)  # no step redone: only the export
    ref = final_weights(reference())
    assert all(final_weights(run)[k].equal(v) for k, v in ref.items())
