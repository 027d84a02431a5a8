"""How late the desktop app's event loop runs while work leaves the GUI thread.

A 10 ms timer on the GUI thread records how late each tick is while (1) the Model page creates the
demo model (a child process) with the Monitor sampling, and (2) the Plan page computes 100 plans
of an 8B model on its worker. The worst lateness is what a user feels as a stall; the figure
depends on the machine's load, so it is measured here, not asserted in the test suite.

    QT_QPA_PLATFORM=offscreen python benchmarks/gui_latency.py [--plans 100]

Prints one JSON line per scenario: {"scenario", "worst_late_ms", "ticks", "elapsed_s"}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from PySide6.QtCore import QObject, QSettings, Qt, QTimer  # noqa: E402
from PySide6.QtTest import QTest  # noqa: E402

PROBE_MS = 10
CONFIG_8B = ROOT / "tests" / "fixtures" / "configs" / "llama-3.1-8b.json"
DESKTOP = {"budget.vram": "24GiB", "budget.ram": "128GiB", "data.max_seq_len": 2048,
           "train.micro_batch": 1, "train.grad_accum": 2}


class LatencyProbe(QObject):
    """A 10 ms timer that records how late each of its ticks is."""

    def __init__(self):
        super().__init__()
        self.timer = QTimer(self)
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(PROBE_MS)
        self.timer.timeout.connect(self._tick)
        self.last: float | None = None
        self.ticks = 0
        self.worst = 0.0

    def _tick(self) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.worst = max(self.worst, now - self.last - PROBE_MS / 1000)
        self.last = now
        self.ticks += 1


def wait_until(cond, timeout_s: float = 120.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError("the app did not get there in time")
        QTest.qWait(5)


def measure(name: str, work) -> dict:
    probe = LatencyProbe()
    probe.timer.start()
    t0 = time.perf_counter()
    work()
    elapsed = time.perf_counter() - t0
    probe.timer.stop()
    return {"scenario": name, "worst_late_ms": round(probe.worst * 1000, 1),
            "ticks": probe.ticks, "elapsed_s": round(elapsed, 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--plans", type=int, default=100)
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="gui-latency-"))
    for var in ("XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME"):
        os.environ[var] = str(tmp / var.lower())
    from slideformer.gui.app import freeze_heap, make_application
    from slideformer.gui.context import AppContext
    from slideformer.gui.main_window import MainWindow
    from slideformer.gui.settings import Settings

    make_application()
    settings = Settings(QSettings(str(tmp / "studio.ini"), QSettings.Format.IniFormat))
    window = MainWindow(AppContext(settings, data_dir=tmp / "data", gpu_source="fake"))
    window.show()
    wait_until(lambda: window.monitor.repaints >= 1)
    freeze_heap()  # as the app does at start-up

    def create_model():
        chosen = []
        window.model_page.model_selected.connect(chosen.append)
        window.model_page.create_demo()
        wait_until(lambda: bool(chosen))

    print(json.dumps(measure("create the demo model, Monitor sampling", create_model)))

    model = tmp / "Llama-3.1-8B"
    model.mkdir()
    shutil.copy(CONFIG_8B, model / "config.json")
    window.show_page("Plan")
    page = window.pages["Plan"]
    wait_until(lambda: page.machine is not None)
    page.ctx.set_model(str(model), {})
    page.inputs.apply(DESKTOP)
    wait_until(page.settled)
    page.debounce.setInterval(1)  # plans back to back, without pauses for typing

    def plans():
        for i in range(a.plans):
            page.inputs.micro_batch.setValue(1 + (i + 1) % 8)
            wait_until(page.settled)

    print(json.dumps(measure(f"{a.plans} plans of an 8B model", plans)))
    window.close()
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
