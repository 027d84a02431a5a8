"""The terminal's view of a run: a tqdm progress bar (percent, steps, elapsed, time left as
h:mm:ss, smoothed tokens/s, loss), log lines above it.

The bar starts at the first step, so the set-up time (loading, the first step's warm-up) does
not enter the rate: from the second step on, the time left is the steps to go times the
smoothed time of the steps so far. On a terminal the bar redraws in place; into a file (the
desktop app's ``engine.log``) it is one line per step.
"""
from __future__ import annotations

import io
import sys

from tqdm import tqdm

from slideformer.engine.events import Log, RunState, StepMetrics

SMOOTHING = 0.3
"""Weight of the newest step in the moving averages of step time and tokens/s (tqdm's
``smoothing``)."""
FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}{postfix}]"


def hms(seconds: float) -> str:
    """3725.2 -> "1:02:05"."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class ProgressPrinter:
    """Trainer callback that draws the progress of a run on ``stream`` (default stdout)."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.bar: tqdm | None = None
        self.tokens_per_s: float | None = None

    def __call__(self, ev) -> None:
        if isinstance(ev, StepMetrics):
            self._step(ev)
        elif isinstance(ev, (Log, RunState)) and getattr(ev, "level", "info") != "debug":
            text = ev.message if isinstance(ev, Log) else f"[{ev.state}] {ev.message}"
            if isinstance(ev, RunState) and ev.state in ("finished", "stopped", "failed"):
                self.close()
            if text.strip():
                self._write(text)

    def _step(self, ev: StepMetrics) -> None:
        if self.bar is None or self.bar.total != ev.total_steps:
            self.close()
            self.bar = tqdm(total=ev.total_steps, initial=ev.step, smoothing=SMOOTHING,
                            bar_format=FORMAT, dynamic_ncols=self.tty, ncols=None if self.tty else 100,
                            file=self.stream if self.tty else io.StringIO(), leave=True)
        else:
            self.bar.update(ev.step - self.bar.n)
        if ev.tokens_per_s:
            old = self.tokens_per_s
            self.tokens_per_s = ev.tokens_per_s if old is None else \
                SMOOTHING * ev.tokens_per_s + (1 - SMOOTHING) * old
        rate = self.bar.format_dict["rate"]  # steps/s, smoothed; None before the second step
        eta = "-:--:--" if not rate else hms((self.bar.total - self.bar.n) / rate)
        loss = "skipped" if ev.loss is None else f"{ev.loss:.4f}"
        tps = "-" if self.tokens_per_s is None else f"{self.tokens_per_s:,.0f}"
        self.bar.set_postfix_str(f"ETA {eta}, {tps} tok/s, loss {loss}", refresh=self.tty)
        if not self.tty:
            self.stream.write(str(self.bar) + "\n")
            self.stream.flush()

    def _write(self, text: str) -> None:
        if self.bar is not None and self.tty:
            self.bar.write(text, file=self.stream)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
