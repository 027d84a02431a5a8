"""The Monitor's readers and ring buffers, without Qt."""
import math

import numpy as np
import psutil
import pytest

from fake_gpu import FakeGpuReader
from slideformer.gui.models.monitor import (GIB, SERIES, GpuReading,
                                            GpuUnavailable, History, HostReader, NvmlReader,
                                            Sample, open_gpu_reader, read_sample)


def _sample(t, cpu, gpu=None):
    return Sample(time=t, gpu=gpu, ram_used=1.0 * t, ram_total=100.0, cpu=cpu)


def test_history_keeps_the_newest_samples_in_time_order():
    h = History(capacity=4)
    assert len(h) == 0 and h.latest("cpu") is None
    for i in range(6):
        h.append(_sample(float(i), cpu=10.0 * i))
    assert len(h) == 4 and h.count == 6
    np.testing.assert_array_equal(h.times(), [2, 3, 4, 5])
    np.testing.assert_array_equal(h.series("cpu"), [20, 30, 40, 50])
    np.testing.assert_array_equal(h.series("ram_used"), [2, 3, 4, 5])
    assert h.latest("cpu") == 50.0


def test_history_partial_fill_and_missing_figures_are_nan():
    h = History(capacity=8)
    gpu = GpuReading(mem_used=5.0, mem_total=10.0, util=None, pcie_rx=1.0, pcie_tx=None,
                     temperature=None, power=None)
    h.append(_sample(0.0, 1.0, gpu))
    h.append(_sample(1.0, 2.0, None))
    assert list(h.series("mem_used")[:1]) == [5.0] and math.isnan(h.series("mem_used")[1])
    assert math.isnan(h.series("util")[0])
    assert h.latest("mem_used") is None  # newest sample had no GPU
    assert set(SERIES) >= {"mem_used", "pcie_rx", "ram_used", "cpu"}


def test_fake_gpu_reader_is_deterministic_and_plausible():
    t = [100.0]
    a, b = FakeGpuReader(clock=lambda: t[0]), FakeGpuReader(clock=lambda: t[0])
    t[0] = 107.5
    ra, rb = a.read(), b.read()
    assert ra == rb
    assert 0 < ra.mem_used < ra.mem_total == 24 * GIB
    assert 0 <= ra.util <= 100 and ra.pcie_rx > 0 and ra.pcie_tx > 0
    assert 20 < ra.temperature < 100 and ra.power > 0


def test_host_reader_reads_this_machine():
    host = HostReader()
    used, total, cpu = host.read()
    assert total == psutil.virtual_memory().total
    assert 0 < used <= total
    assert 0.0 <= cpu <= 100.0
    s = read_sample(None, host)
    assert s.gpu is None and s.ram_total == total


def test_gpu_sources():
    assert isinstance(open_gpu_reader(FakeGpuReader), FakeGpuReader)
    with pytest.raises(GpuUnavailable):
        open_gpu_reader("none")
    with pytest.raises(ValueError):
        open_gpu_reader("cuda")
    try:  # on a machine without NVIDIA GPU this must be GpuUnavailable, nothing else
        reader = open_gpu_reader("nvml")
    except GpuUnavailable as e:
        assert "NVML" in str(e)
    else:
        assert reader.read().mem_total > 0
        reader.close()


def test_nvml_reader_converts_units_and_tolerates_unsupported_figures(fake_nvml):
    nv = fake_nvml()
    reader = NvmlReader()
    assert reader.name == "NVIDIA GeForce RTX 4090"
    r = reader.read()
    assert r.mem_used == 6 * GIB and r.mem_total == 24 * GIB and r.util == 87.0
    assert r.pcie_rx == 20_000_000 * 1024 and r.pcie_tx == 5_000_000 * 1024
    assert r.temperature == 71.0 and r.power is None
    reader.close()
    assert nv.shutdowns == 1


def test_nvml_reader_without_gpu_says_why(fake_nvml):
    fake_nvml(init_error="Driver Not Loaded")
    with pytest.raises(GpuUnavailable, match="Driver Not Loaded"):
        NvmlReader()
    nv = fake_nvml(count=0)
    with pytest.raises(GpuUnavailable, match="no GPU"):
        NvmlReader()
    assert nv.shutdowns == 1
