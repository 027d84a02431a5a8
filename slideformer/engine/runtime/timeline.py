"""Per-step timeline: spans of compute, H2D, D2H and optimizer work per window item.

Device spans are pairs of backend handles (CUDA events with timing, or CPU timestamps) resolved
once the step's work is complete; host spans (the CPU optimizer) are ``perf_counter`` pairs.
Times are seconds from the step start. CUDA event times are aligned with host time at the step
start mark, which is exact when the GPU is idle there (it is: the step starts after the clip
barrier or the last update).
"""
from __future__ import annotations

import threading
import time

from slideformer.engine.events import Span


class StepTimeline:
    """Collects spans of one step."""

    def __init__(self, backend, enabled: bool = True):
        self.backend, self.enabled = backend, enabled
        self.start_mark = backend.mark() if enabled else None
        self.t0 = time.perf_counter()
        self.device: list[tuple[str, str, object, object]] = []
        self.host: list[Span] = []
        self._lock = threading.Lock()

    def device_span(self, lane: str, item: str, start, end) -> None:
        if self.enabled:
            self.device.append((lane, item, start, end))

    def host_span(self, lane: str, item: str, t_start: float, t_end: float) -> None:
        if self.enabled:
            with self._lock:
                self.host.append(Span(lane, item, t_start - self.t0, t_end - self.t0))

    def resolve(self) -> tuple[Span, ...]:
        """All spans in seconds from the step start (call once the step's work finished)."""
        out = list(self.host)
        for lane, item, a, b in self.device:
            out.append(Span(lane, item, self._t(a), self._t(b)))
        return tuple(sorted(out, key=lambda s: s.start))

    def _t(self, handle) -> float:
        if hasattr(handle, "event"):
            return self.start_mark.event.elapsed_time(handle.event) / 1000.0
        return handle.t - self.t0
