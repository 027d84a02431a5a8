"""A stand-in GPU for the Monitor's tests (the product reads real GPUs through NVML only)."""
from __future__ import annotations

import math
import time

from slideformer.gui.models.monitor import GIB, GpuReading


class FakeGpuReader:
    """A 24 GiB GPU whose figures follow slow deterministic waves (tests, screenshots)."""

    name = "Simulated GPU (24 GiB)"

    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._t0 = clock()

    def read(self) -> GpuReading:
        t = self._clock() - self._t0
        wave = 0.5 + 0.5 * math.sin(t / 3.0)
        return GpuReading(mem_used=(14.0 + 6.0 * wave) * GIB, mem_total=24.0 * GIB,
                          util=60.0 + 35.0 * math.sin(t * 1.3),
                          pcie_rx=(18.0 + 6.0 * wave) * 1e9, pcie_tx=(9.0 + 5.0 * (1 - wave)) * 1e9,
                          temperature=55.0 + 15.0 * wave, power=180.0 + 200.0 * wave)

    def close(self) -> None:
        pass
