"""The run folder's control file: commands reach the Trainer, the file names a live process."""
import os
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


def wait_for(cond, timeout=120.0):
    """Poll until ``cond``; the timeout only turns a hang into a failure (no latency bound)."""
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_commands_reach_the_trainer_and_the_file_names_the_process(tmp_path):
    send_command(tmp_path, "stop")  # meant for an earlier process: dropped at start
    control, trainer = RunControl(tmp_path), FakeTrainer()
    assert engine_alive(tmp_path) is None
    with control.attached(trainer):
        control.on_event(RunState("setup"))
        assert engine_alive(tmp_path) == os.getpid()
        for command in ("pause", "resume", "abort", "stop"):
            send_command(tmp_path, command)
        wait_for(lambda: len(trainer.calls) == 4)
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
