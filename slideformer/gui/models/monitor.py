"""Hardware readings for the Monitor, without Qt: GPU readers, the host reader, ring buffers.

A *GPU reader* has ``name`` and ``read() -> GpuReading``: :class:`NvmlReader` (through
``pynvml``), or none at all (tests bring their own stand-in). :func:`open_gpu_reader` turns a
source into a reader
or a :class:`GpuUnavailable` that says why there is none. :class:`HostReader` reads RAM and CPU
through ``psutil``. :func:`read_sample` combines both into one :class:`Sample`, and
:class:`History` keeps the last few minutes of samples in fixed-size numpy ring buffers that the
plots read from. A figure the hardware does not report is ``None`` in a reading and NaN in the
history (plots leave a gap).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields

import numpy as np
import psutil

GIB = 1 << 30
GPU_SOURCES = ("nvml", "none")


@dataclass(frozen=True)
class GpuReading:
    """One GPU's figures at one instant; ``None`` where the GPU does not report one."""

    mem_used: float | None
    """GPU memory in use, bytes."""
    mem_total: float | None
    """GPU memory installed, bytes."""
    util: float | None
    """Share of the last sample period a kernel was running, percent."""
    pcie_rx: float | None
    """PCIe traffic host -> GPU, bytes/s."""
    pcie_tx: float | None
    """PCIe traffic GPU -> host, bytes/s."""
    temperature: float | None
    """GPU core temperature, degrees Celsius."""
    power: float | None
    """Board power draw, watts."""


@dataclass(frozen=True)
class Sample:
    """GPU and host figures at one instant (``time`` in seconds, ``time.monotonic``)."""

    time: float
    gpu: GpuReading | None
    """None when the Monitor has no GPU to read."""
    ram_used: float
    """Host memory in use (total minus available), bytes."""
    ram_total: float
    cpu: float
    """Host CPU use over all cores since the previous sample, percent."""


class GpuUnavailable(Exception):
    """No GPU can be read; the message says why in words for people."""


class NvmlReader:
    """Reads GPU ``index`` through NVML. Raises :class:`GpuUnavailable` if NVML cannot start."""

    def __init__(self, index: int = 0):
        import pynvml
        self._nvml = pynvml
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise GpuUnavailable(f"NVML could not start ({e})") from None
        try:
            if pynvml.nvmlDeviceGetCount() <= index:
                raise GpuUnavailable("NVML found no GPU")
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(self._handle)
        except pynvml.NVMLError as e:
            pynvml.nvmlShutdown()
            raise GpuUnavailable(f"NVML could not open GPU {index} ({e})") from None
        except GpuUnavailable:
            pynvml.nvmlShutdown()
            raise
        self.name = name.decode() if isinstance(name, bytes) else str(name)

    def _get(self, fn, *args):
        """``fn(handle, *args)``, or None when this GPU or driver does not report it."""
        try:
            return fn(self._handle, *args)
        except self._nvml.NVMLError:
            return None

    def read(self) -> GpuReading:
        nv = self._nvml
        mem = self._get(nv.nvmlDeviceGetMemoryInfo)
        util = self._get(nv.nvmlDeviceGetUtilizationRates)
        # PCIe counters are KB/s averaged over a 20 ms window inside the driver.
        rx = self._get(nv.nvmlDeviceGetPcieThroughput, nv.NVML_PCIE_UTIL_RX_BYTES)
        tx = self._get(nv.nvmlDeviceGetPcieThroughput, nv.NVML_PCIE_UTIL_TX_BYTES)
        temp = self._get(nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
        power = self._get(nv.nvmlDeviceGetPowerUsage)  # milliwatts
        return GpuReading(
            mem_used=None if mem is None else float(mem.used),
            mem_total=None if mem is None else float(mem.total),
            util=None if util is None else float(util.gpu),
            pcie_rx=None if rx is None else rx * 1024.0,
            pcie_tx=None if tx is None else tx * 1024.0,
            temperature=None if temp is None else float(temp),
            power=None if power is None else power / 1000.0)

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError:
            pass


def open_gpu_reader(source):
    """A GPU reader for ``source``: "nvml", "none", or a function that makes a reader (tests
    pass their stand-ins that way; the product reads real GPUs only).

    Raises:
        GpuUnavailable: the source is "none", or NVML has no GPU to read.
    """
    if source == "nvml":
        return NvmlReader()
    if callable(source):
        return source()
    if source == "none":
        raise GpuUnavailable("GPU monitoring is off")
    raise ValueError(f"GPU source must be one of {GPU_SOURCES}, not {source!r}")


class HostReader:
    """Host RAM and CPU use through psutil."""

    def __init__(self):
        psutil.cpu_percent(interval=None)  # the first call only starts the measurement window

    def read(self) -> tuple[float, float, float]:
        """(RAM used bytes, RAM total bytes, CPU percent since the previous call)."""
        vm = psutil.virtual_memory()
        return float(vm.total - vm.available), float(vm.total), psutil.cpu_percent(interval=None)


def read_sample(gpu, host: HostReader, clock=time.monotonic) -> Sample:
    """One :class:`Sample` from a GPU reader (or None) and the host reader."""
    ram_used, ram_total, cpu = host.read()
    return Sample(time=clock(), gpu=None if gpu is None else gpu.read(),
                  ram_used=ram_used, ram_total=ram_total, cpu=cpu)


# Columns of the history: every GpuReading field, then the host figures.
SERIES = tuple(f.name for f in fields(GpuReading)) + ("ram_used", "ram_total", "cpu")


def _columns(s: Sample) -> list[float]:
    g = s.gpu
    gpu = [math.nan if g is None or getattr(g, f.name) is None else getattr(g, f.name)
           for f in fields(GpuReading)]
    return gpu + [s.ram_used, s.ram_total, s.cpu]


class History:
    """The last ``capacity`` samples in numpy ring buffers, one column per :data:`SERIES` name.

    Single-threaded by design: the GUI thread appends (samples arrive through a signal) and the
    plots read. Reads return copies in time order, oldest first.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._t = np.zeros(capacity)
        self._v = np.full((capacity, len(SERIES)), np.nan)
        self._next = 0
        self.count = 0
        """Samples appended since creation (not capped by capacity)."""

    def __len__(self) -> int:
        return min(self.count, self.capacity)

    def append(self, sample: Sample) -> None:
        i = self._next
        self._t[i] = sample.time
        self._v[i] = _columns(sample)
        self._next = (i + 1) % self.capacity
        self.count += 1

    def _ordered(self, a: np.ndarray) -> np.ndarray:
        if self.count < self.capacity:
            return a[:self.count].copy()
        return np.concatenate((a[self._next:], a[:self._next]))

    def times(self) -> np.ndarray:
        """Sample times, oldest first."""
        return self._ordered(self._t)

    def series(self, name: str) -> np.ndarray:
        """Values of one :data:`SERIES` column, aligned with :meth:`times`."""
        return self._ordered(self._v[:, SERIES.index(name)])

    def latest(self, name: str) -> float | None:
        """The newest value of ``name``; None when empty or not reported."""
        if not self.count:
            return None
        v = float(self._v[(self._next - 1) % self.capacity, SERIES.index(name)])
        return None if math.isnan(v) else v
