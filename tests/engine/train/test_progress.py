"""The terminal progress bar: percent, steps, and a time left that is the arithmetic of the
steps so far from the second step on (the set-up time before the first step does not count)."""
from __future__ import annotations

import io

import pytest

from slideformer.engine.events import Log, RunState, StepMetrics
from slideformer.engine.train.progress import ProgressPrinter, hms


class Clock:
    def __init__(self, t: float):
        self.t = t

    def __call__(self) -> float:
        return self.t


def step(n: int, total: int, tps: float) -> StepMetrics:
    return StepMetrics(step=n, total_steps=total, loss=2.0, lr=1e-4, grad_norm=1.0, tokens=1000,
                       tokens_per_s=tps, step_time=2.0, peak_vram=None, peak_ram=None)


def test_hms():
    assert hms(0) == "0:00:00" and hms(59.6) == "0:01:00" and hms(3725) == "1:02:05"
    assert hms(15_114) == "4:11:54"


def test_eta_from_the_second_step(monkeypatch):
    clock = Clock(1000.0)
    monkeypatch.setattr("tqdm.std.time", clock)
    out = io.StringIO()
    p = ProgressPrinter(out)
    p(RunState("setup", "loading model and data"))
    clock.t += 60  # loading and the first step's warm-up: not part of the rate
    p(step(1, 180, 500.0))
    clock.t += 2.0
    p(step(2, 180, 500.0))
    lines = out.getvalue().splitlines()
    assert lines[0] == "[setup] loading model and data"
    assert "ETA -:--:--" in lines[1]  # one step says nothing about the rate
    assert "1%" in lines[2] and "2/180 steps" in lines[2]
    assert f"ETA {hms(178 * 2.0)}" in lines[2]  # 0:05:56
    assert "500 tok/s" in lines[2] and "loss 2.0000" in lines[2]
    clock.t += 2.0
    p(step(3, 180, 1500.0))
    assert "800 tok/s" in out.getvalue().splitlines()[-1]  # 0.3 * 1500 + 0.7 * 500
    p(Log("info", "a log line"))
    p(RunState("finished", "model saved"))
    assert out.getvalue().splitlines()[-2:] == ["a log line", "[finished] model saved"]
    assert p.bar is None
