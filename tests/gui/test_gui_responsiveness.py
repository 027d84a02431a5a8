"""The GUI thread never blocks: an event-loop latency probe while work runs in the background."""
import time

import pytest
from PySide6.QtCore import QObject, Qt, QTimer

from slideformer_gui.app import freeze_heap, make_application
from slideformer_gui.context import AppContext
from slideformer_gui.main_window import MainWindow

from fake_gpu import FakeGpuReader

PROBE_MS = 10
MAX_LATE_S = 0.050


class LatencyProbe(QObject):
    """A 10 ms timer that records how late each of its ticks is."""

    def __init__(self):
        super().__init__()
        self.timer = QTimer(self)
        self.timer.setTimerType(Qt.TimerType.PreciseTimer)
        self.timer.setInterval(PROBE_MS)
        self.timer.timeout.connect(self._tick)
        self.last = None
        self.ticks = 0
        self.worst = 0.0

    def _tick(self):
        now = time.perf_counter()
        if self.last is not None:
            self.worst = max(self.worst, now - self.last - PROBE_MS / 1000)
        self.last = now
        self.ticks += 1


@pytest.fixture
def busy_window(qtbot, settings, tmp_path):
    make_application()
    w = MainWindow(AppContext(settings, data_dir=tmp_path / "data", gpu_source=FakeGpuReader))
    qtbot.addWidget(w)
    freeze_heap()  # as the app does at start-up
    w.show()
    qtbot.waitUntil(lambda: w.monitor.repaints >= 1, timeout=5000)  # first paint done
    yield w
    w.close()


def test_event_loop_stays_responsive_while_sampling_and_creating_a_model(qtbot, busy_window):
    w = busy_window
    probe = LatencyProbe()
    probe.timer.start()
    samples, repaints = w.monitor.history.count, w.monitor.repaints
    t0 = time.perf_counter()
    with qtbot.waitSignal(w.model_page.model_selected, timeout=20000):
        w.model_page.create_demo()
    qtbot.wait(max(0, int(1500 - 1000 * (time.perf_counter() - t0))))  # >= 1.5 s of sampling
    probe.timer.stop()

    assert w.monitor.history.count - samples >= 4  # the sampler ran at ~4 Hz meanwhile
    assert w.monitor.repaints - repaints >= 3
    assert probe.ticks >= 50
    assert probe.worst < MAX_LATE_S, f"the GUI thread stalled for {probe.worst * 1000:.0f} ms"
