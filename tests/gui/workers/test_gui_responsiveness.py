"""Work leaves the GUI thread: the Monitor keeps sampling and repainting while a model is made.

How late the event loop runs meanwhile depends on the machine's load: it is measured by
``benchmarks/gui_latency.py``, not asserted here.
"""
import time

import pytest

from slideformer.gui.app import freeze_heap, make_application
from slideformer.gui.context import AppContext
from slideformer.gui.main_window import MainWindow

from fake_gpu import FakeGpuReader


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
    samples, repaints = w.monitor.history.count, w.monitor.repaints
    t0 = time.perf_counter()
    with qtbot.waitSignal(w.model_page.model_selected, timeout=120_000):  # a bound, not a speed
        w.model_page.create_demo()
    qtbot.wait(max(0, int(1500 - 1000 * (time.perf_counter() - t0))))  # >= 1.5 s of sampling

    assert w.monitor.history.count - samples >= 4  # the sampler ran at ~4 Hz meanwhile
    assert w.monitor.repaints - repaints >= 3
