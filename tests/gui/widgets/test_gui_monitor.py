"""The Monitor: the sampler's thread feeds the ring buffers, the timer feeds the charts."""
import numpy as np
import pytest

from slideformer.gui.widgets.monitor import CHARTS, MonitorPanel, value_text
from slideformer.gui.workers.sampler import NO_GPU_NOTICE, MonitorSampler
from slideformer.gui.models.monitor import GIB

from fake_gpu import FakeGpuReader


@pytest.fixture
def monitor(qtbot, request):
    """A shown panel wired to a sampler on the source given by the test's parameter."""
    panel = MonitorPanel()
    qtbot.addWidget(panel)
    panel.resize(400, 800)
    panel.show()
    sampler = MonitorSampler(request.param, rate_hz=20.0)
    sampler.sampled.connect(panel.add_sample)
    sampler.gpu_found.connect(panel.show_gpu)
    sampler.gpu_missing.connect(panel.show_no_gpu)
    yield panel, sampler
    sampler.stop()


def _curve(panel, title):
    view = next(v for v in panel.charts if v.chart.title == title)
    return view, view.curves


@pytest.mark.parametrize("monitor", ["nvml"], indirect=True)
def test_fake_nvml_figures_reach_the_ring_buffers_and_the_charts(qtbot, monitor, fake_nvml):
    fake_nvml()
    panel, sampler = monitor
    with qtbot.waitSignal(sampler.gpu_found, timeout=5000) as found:
        sampler.start()
    assert found.args == ["NVIDIA GeForce RTX 4090"]
    qtbot.waitUntil(lambda: panel.history.count >= 3 and panel.repaints >= 1, timeout=5000)
    assert panel.notice.isHidden() and panel.device.text() == "NVIDIA GeForce RTX 4090"

    assert panel.history.latest("mem_used") == 6 * GIB
    assert panel.history.latest("pcie_rx") == 20_000_000 * 1024
    assert panel.history.latest("power") is None  # not reported by this GPU
    view, (used,) = _curve(panel, "GPU memory")
    qtbot.waitUntil(lambda: len(used.getData()[1]) == len(panel.history), timeout=2000)
    x, y = used.getData()
    np.testing.assert_allclose(y, 6.0)  # GiB
    assert x[-1] == 0 and np.all(np.diff(x) > 0)  # seconds ago, oldest first
    assert view.value.text() == "6.0 / 24.0 GiB"
    _, (rx, tx) = _curve(panel, "PCIe")
    assert rx.getData()[1][-1] == pytest.approx(20_000_000 * 1024 / 1e9)
    assert "n/a" in value_text(next(c for c in CHARTS if c.title == "GPU power"), panel.history)


@pytest.mark.parametrize("monitor", [FakeGpuReader], indirect=True)
def test_fake_gpu_and_real_psutil_figures_all_show(qtbot, monitor):
    panel, sampler = monitor
    sampler.start()
    qtbot.waitUntil(lambda: panel.history.count >= 3 and panel.repaints >= 1, timeout=5000)
    assert all(v.isVisible() for v in panel.charts)
    for view in panel.charts:
        for curve, spec in zip(view.curves, view.chart.curves):
            y = curve.getData()[1]
            assert y is not None and np.isfinite(y).all(), spec.series
    assert panel.history.latest("ram_total") > 0
    assert 0 <= panel.history.latest("cpu") <= 100


@pytest.mark.parametrize("monitor", ["none"], indirect=True)
def test_without_gpu_host_figures_and_one_notice(qtbot, monitor):
    panel, sampler = monitor
    with qtbot.waitSignal(sampler.gpu_missing, timeout=5000):
        sampler.start()
    qtbot.waitUntil(lambda: panel.history.count >= 2 and panel.repaints >= 1, timeout=5000)
    assert panel.notice.isVisible() and panel.notice.text() == NO_GPU_NOTICE
    assert panel.device.isHidden()
    shown = [v.chart.title for v in panel.charts if v.isVisible()]
    assert shown == ["Host RAM", "CPU"]
    (ram,) = _curve(panel, "Host RAM")[1]
    assert np.isfinite(ram.getData()[1]).all()


@pytest.mark.parametrize("monitor", ["none"], indirect=True)
def test_sampler_stops_promptly(monitor):
    _, sampler = monitor
    sampler.start()
    assert sampler.is_running()
    sampler.stop()
    assert not sampler.is_running()
