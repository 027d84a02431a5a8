"""The run folder's control file: commands reach the Trainer, the file names a live process."""
import os
import threading
import time

import pytest

from slideformer.engine.errors import UserError
from slideformer.engine.events import RunState
from slideformer.engine.train.control import CONTROL_FILE, RunControl, engine_alive, send_command


class FakeTrainer:
    def __init__(self):
        self.calls, self.events, self.step = [], [], 7
        self.sink = self  # RunControl reports a failure through trainer.sink.emit

    def pause(self):
        self.calls.append("pause")

    def resume(self):
        self.calls.append("resume")

    def stop(self, save=True):
        self.calls.append(f"stop(save={save})")

    def emit(self, ev):
        self.events.append(ev)


class CountingStop(threading.Event):
    """The command reader's stop event, counting the reader's polls (one wait each)."""

    def __init__(self):
        super().__init__()
        self.polls = 0

    def wait(self, timeout=None):
        self.polls += 1
        return super().wait(timeout)


def after_reads(control: RunControl, n: int = 2) -> None:
    """Return once the reader has read the file anew after this call: polls counted at each
    wait's start, so the read after the next wait ends began after the call. Bounded by the
    reader's own loop, not by a clock (a reader thread that died ends it too)."""
    target = control._stop.polls + n
    while control._stop.polls < target and control._thread.is_alive():
        time.sleep(0.02)


def test_commands_reach_the_trainer_and_the_file_names_the_process(tmp_path):
    send_command(tmp_path, "stop")  # meant for an earlier process: dropped at start
    control, trainer = RunControl(tmp_path), FakeTrainer()
    control._stop = CountingStop()
    assert engine_alive(tmp_path) is None
    with control.attached(trainer):
        control.on_event(RunState("setup"))
        assert engine_alive(tmp_path) == os.getpid()
        for command in ("pause", "resume", "abort", "stop"):
            send_command(tmp_path, command)
        after_reads(control)
    assert trainer.calls == ["pause", "resume", "stop(save=False)", "stop(save=True)"]
    assert not (tmp_path / CONTROL_FILE).exists() and engine_alive(tmp_path) is None
    with pytest.raises(ValueError):
        send_command(tmp_path, "reboot")


def test_a_killed_process_leaves_a_mark_that_is_not_alive(tmp_path):
    (tmp_path / CONTROL_FILE).write_text(f"# engine pid={os.getpid()} started=12.0\n")
    assert engine_alive(tmp_path) is None  # the pid is alive but started at another time


def test_a_failure_is_reported_as_an_event_once_the_folder_is_ours(tmp_path):
    trainer = FakeTrainer()
    with pytest.raises(UserError):
        with RunControl(tmp_path).attached(trainer):
            raise UserError("data.train", "is missing", "choose a file")
    assert trainer.events == []  # rejected before the first event: not this run's folder
    with pytest.raises(RuntimeError):
        control = RunControl(tmp_path)
        with control.attached(trainer):
            control.on_event(RunState("setup"))
            raise RuntimeError("boom")
    (failed,) = trainer.events
    assert failed.state == "failed" and failed.message == "RuntimeError: boom" and failed.step == 7
