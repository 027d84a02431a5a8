"""Activation checkpoint stores: each layer's input per micro-batch, kept for the recompute.

``DeviceStore`` keeps them in one preallocated device buffer. ``HostStore`` copies them to
pinned host memory during the forward (device->host stream) and brings a layer's inputs back
into one of two device staging buffers one layer ahead of the backward (host->device stream).
Both are allocated once: shape (layers, micro-batches, B, T, H). ``SplitStore`` keeps the top
layers' on the device and the others on the host (ExecShape.gpu_checkpoints).
"""
from __future__ import annotations

import torch


class DeviceStore:
    """Checkpoints in device memory."""

    def __init__(self, backend, layers: int, n_micro: int, shape: tuple, dtype):
        self.buf = backend.alloc((layers, n_micro) + tuple(shape), dtype)

    def save(self, layer: int, mb: int, x: torch.Tensor) -> None:
        self.buf[layer, mb].copy_(x)

    def prefetch(self, layer: int) -> None:
        pass

    def load(self, layer: int, mb: int) -> torch.Tensor:
        return self.buf[layer, mb]

    def done_with(self, layer: int) -> None:
        pass


class HostStore:
    """Checkpoints in pinned host memory, prefetched one layer ahead of the backward."""

    def __init__(self, backend, layers: int, n_micro: int, shape: tuple, dtype):
        self.backend = backend
        self.host = backend.host_alloc((layers, n_micro) + tuple(shape), dtype)
        self.staging = backend.alloc((2, n_micro) + tuple(shape), dtype)
        self.saved: dict[tuple[int, int], object] = {}
        self.loaded: dict[int, tuple[int, object]] = {}
        self.staging_free: list = [[], []]

    def save(self, layer: int, mb: int, x: torch.Tensor) -> None:
        self.backend.keep_alive(x)
        self.saved[layer, mb] = self.backend.start_d2h(self.host[layer, mb], x,
                                                       after=[self.backend.mark()])

    def prefetch(self, layer: int) -> None:
        """Start copying a layer's checkpoints into a staging buffer (if not already)."""
        if layer < 0 or layer in self.loaded:
            return
        idx = layer % 2
        after = [h for (ly, _), h in self.saved.items() if ly == layer] + self.staging_free[idx]
        handle = self.backend.start_h2d(self.staging[idx], self.host[layer], after=after)
        self.loaded[layer] = (idx, handle)
        self.staging_free[idx] = []

    def load(self, layer: int, mb: int) -> torch.Tensor:
        self.prefetch(layer)
        idx, handle = self.loaded[layer]
        self.backend.compute_waits(handle)
        return self.staging[idx, mb]

    def done_with(self, layer: int) -> None:
        """The backward of ``layer`` is issued: its staging buffer may be refilled after it."""
        idx, _ = self.loaded.pop(layer)
        self.staging_free[idx].append(self.backend.mark())
        for mb in [k for k in self.saved if k[0] == layer]:
            del self.saved[mb]


class SplitStore:
    """Host checkpoints for layers 0 .. L-g-1, device ones for the top ``on_device`` = g layers
    (ExecShape.gpu_checkpoints): the layers the backward meets first need no copy back, and
    host RAM holds g layers' checkpoints less."""

    def __init__(self, backend, layers: int, n_micro: int, shape: tuple, dtype, on_device: int):
        self.first = layers - on_device
        """The lowest layer whose checkpoints stay on the device."""
        self.host = HostStore(backend, self.first, n_micro, shape, dtype)
        self.device = DeviceStore(backend, on_device, n_micro, shape, dtype)

    def _of(self, layer: int):
        return (self.device, layer - self.first) if layer >= self.first else (self.host, layer)

    def save(self, layer: int, mb: int, x: torch.Tensor) -> None:
        store, j = self._of(layer)
        store.save(j, mb, x)

    def prefetch(self, layer: int) -> None:
        if layer < self.first:
            self.host.prefetch(layer)

    def load(self, layer: int, mb: int) -> torch.Tensor:
        store, j = self._of(layer)
        return store.load(j, mb)

    def done_with(self, layer: int) -> None:
        store, j = self._of(layer)
        store.done_with(j)
