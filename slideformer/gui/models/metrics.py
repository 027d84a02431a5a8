"""What the Train page plots, without Qt: per-step series from the engine's events, and the run's
progress (ETA, stall) as the user reads it.

:class:`StepHistory` keeps one row per optimizer step in fixed-size numpy buffers. A whole run
stays on screen, however long: when the buffers are full, every other row is dropped and the
stride doubles (a loss curve needs its start; a ring buffer would lose it). A resumed run that
repeats steps after its last checkpoint *replaces* them: the curves show one line, the one the
model actually followed.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from slideformer.engine.api import EvalMetrics, PairMetrics, RolloutMetrics, StepMetrics

PAIR_COLUMNS = ("chosen_reward", "rejected_reward", "margin", "accuracy")
"""A preference run's columns (PairMetrics): NaN in a supervised run's rows."""
COLUMNS = ("step", "loss", "smooth", "lr", "grad_norm", "tokens_per_s", "step_time",
           "peak_vram", "peak_ram", *PAIR_COLUMNS, "reward_mean")
"""``reward_mean``: a GRPO run's mean reward of the step's replies (RolloutMetrics)."""
SMOOTHING = 0.9
"""Weight of the past in the smoothed loss (an exponential moving average, bias-corrected, as
TensorBoard draws it)."""
CAPACITY = 8192
STALL_FACTOR = 10.0
STALL_MIN_S = 30.0
"""No step for STALL_FACTOR times the usual step time (and at least STALL_MIN_S) is a stall."""
RECENT = 20
"""Steps whose median step time is "the usual step time"."""


def _nan(v) -> float:
    return math.nan if v is None else float(v)


class StepHistory:
    """Per-step metrics of one run, read by the plots as aligned numpy arrays."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._rows = np.full((capacity, len(COLUMNS)), np.nan)
        self._n = 0
        self.stride = 1
        """Steps per stored row (doubles each time the buffers fill)."""
        self._ema = (0.0, 0)
        """(moving average before bias correction, losses in it) after the last step."""
        self.val_steps: list[int] = []
        self.val_losses: list[float] = []
        self.last: StepMetrics | None = None
        self.recent_times: list[float] = []
        self.version = 0
        """Bumped on every change: the plots repaint only when it moved."""
        self.has_pairs = False
        """The run reports preference rewards (PairMetrics)."""
        self.has_rollouts = False
        """The run reports sampled replies' rewards (RolloutMetrics, GRPO)."""

    def __len__(self) -> int:
        return self._n

    def column(self, name: str) -> np.ndarray:
        return self._rows[:self._n, COLUMNS.index(name)]

    def add(self, ev) -> None:
        """Take a StepMetrics, EvalMetrics, PairMetrics or RolloutMetrics event (others are
        ignored)."""
        if isinstance(ev, StepMetrics):
            self._add_step(ev)
        elif isinstance(ev, RolloutMetrics):
            if self._n and self._rows[self._n - 1, 0] == ev.step:  # its step's row (kept)
                self._rows[self._n - 1, COLUMNS.index("reward_mean")] = ev.reward_mean
            self.has_rollouts = True
            self.version += 1
        elif isinstance(ev, PairMetrics):
            if self._n and self._rows[self._n - 1, 0] == ev.step:  # its step's row (kept)
                at = COLUMNS.index(PAIR_COLUMNS[0])
                self._rows[self._n - 1, at:at + 4] = (ev.chosen_reward, ev.rejected_reward,
                                                      ev.margin, ev.accuracy)
            self.has_pairs = True
            self.version += 1
        elif isinstance(ev, EvalMetrics):
            self._rewind_val(ev.step)
            self.val_steps.append(ev.step)
            self.val_losses.append(ev.val_loss)
            self.version += 1

    def _add_step(self, ev: StepMetrics) -> None:
        if self.last is not None and ev.step <= self.last.step:
            self._rewind(ev.step)
        self.last = ev
        self.recent_times = (self.recent_times + [ev.step_time])[-RECENT:]
        self.version += 1
        if ev.skipped:
            return
        ema, n = self._ema
        if ev.loss is not None:
            ema, n = SMOOTHING * ema + (1 - SMOOTHING) * ev.loss, n + 1
        self._ema = (ema, n)
        if ev.step % self.stride:
            return
        if self._n == self.capacity:
            self._rows[:self._n // 2] = self._rows[1:self._n:2]
            self._n //= 2
            self.stride *= 2
            if ev.step % self.stride:
                return
        smooth = ema / (1 - SMOOTHING ** n) if n else math.nan
        self._rows[self._n] = (ev.step, _nan(ev.loss), smooth, ev.lr, _nan(ev.grad_norm),
                               _nan(ev.tokens_per_s), ev.step_time, _nan(ev.peak_vram),
                               _nan(ev.peak_ram), *[math.nan] * (len(PAIR_COLUMNS) + 1))
        self._n += 1

    def _rewind(self, step: int) -> None:
        """Forget rows from ``step`` on (a resumed run is about to report them again)."""
        keep = int(np.searchsorted(self.column("step"), step, side="left"))
        self._n = keep
        # The moving average restarts from the last kept row (exact at stride 1).
        n = int(np.count_nonzero(~np.isnan(self.column("loss"))))
        smooth = self._rows[keep - 1, COLUMNS.index("smooth")] if keep else math.nan
        self._ema = (float(smooth) * (1 - SMOOTHING ** n), n) if n else (0.0, 0)
        self._rewind_val(step)

    def _rewind_val(self, step: int) -> None:
        while self.val_steps and self.val_steps[-1] >= step:
            self.val_steps.pop()
            self.val_losses.pop()

    def usual_step_time(self) -> float | None:
        """Median step time of the recent steps (None before the second step: the first one
        includes warm-up)."""
        times = self.recent_times[1:] if len(self.recent_times) < RECENT else self.recent_times
        return float(np.median(times)) if times else None


@dataclass(frozen=True)
class ProgressText:
    fraction: float
    text: str


def progress(history: StepHistory, running: bool = True) -> ProgressText | None:
    """Step x/y, seconds per step and, while the run trains, the time left."""
    ev = history.last
    if ev is None or not ev.total_steps:
        return None
    usual = history.usual_step_time() or ev.step_time
    text = f"step {ev.step:,} / {ev.total_steps:,}   ·   {format_seconds(usual)} per step"
    if running:  # a stopped, paused or finished run has no time left to count down
        text += f"   ·   {format_seconds(max(0, ev.total_steps - ev.step) * usual)} left"
    return ProgressText(ev.step / ev.total_steps, text)


def stall_seconds(history: StepHistory, since_last_step: float) -> float | None:
    """How long past its usual pace the run has gone without a step, or None if it has not."""
    usual = history.usual_step_time()
    if usual is None:
        return None
    limit = max(STALL_FACTOR * usual, STALL_MIN_S)
    return since_last_step if since_last_step > limit else None


def format_seconds(s: float) -> str:
    """0.0234 -> "23 ms", 75 -> "1 min 15 s", 7500 -> "2 h 05 min"."""
    if s < 1:
        return f"{s * 1000:.0f} ms"
    if s < 60:
        return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def now() -> float:
    return time.monotonic()
