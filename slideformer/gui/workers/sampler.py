"""The Monitor's sampler: reads the hardware on its own thread and hands samples over by signal.

NVML calls can take tens of milliseconds (the PCIe counters integrate over a 20 ms window), and
NVML's start-up can take longer, so both happen on a plain Python thread. The thread touches no
widget: it emits :attr:`MonitorSampler.sampled` and Qt queues the call into the GUI thread.
"""
from __future__ import annotations

import threading

from PySide6.QtCore import QObject, Signal

from slideformer.gui.models.monitor import GpuUnavailable, HostReader, open_gpu_reader, read_sample

NO_GPU_NOTICE = "No NVIDIA GPU found:\nhost figures only"  # two short lines: a narrow dock


class MonitorSampler(QObject):
    """Samples GPU (``gpu_source``: see ``open_gpu_reader``) and host figures at ``rate_hz``."""

    gpu_found = Signal(str)
    """The GPU's name, once the reader is open."""
    gpu_missing = Signal(str, str)
    """(notice for the panel, technical reason) when there is no GPU to read."""
    sampled = Signal(object)
    """A :class:`~slideformer.gui.models.monitor.Sample`."""

    def __init__(self, gpu_source: str = "nvml", rate_hz: float = 4.0, parent=None):
        super().__init__(parent)
        self.gpu_source = gpu_source
        self.interval = 1.0 / rate_hz
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="monitor-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to finish and wait for it (at most one sample's worth of time)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._thread = None

    def is_running(self) -> bool:
        return self._thread is not None

    def _run(self) -> None:
        host = HostReader()
        try:
            gpu = open_gpu_reader(self.gpu_source)
        except GpuUnavailable as e:
            gpu = None
            self.gpu_missing.emit(NO_GPU_NOTICE, str(e))
        else:
            self.gpu_found.emit(gpu.name)
        try:
            while not self._stop.is_set():
                self.sampled.emit(read_sample(gpu, host))
                self._stop.wait(self.interval)
        finally:
            if gpu is not None:
                gpu.close()
