"""Where a generating model's weights live: all resident, or layers streamed through a window.

Both hold the embedding and the head (final norm + LM head) on the device and hand out decoder
layers in order through :meth:`layers` (and adapters to apply over a layer through
``adapters(i)``: none here, their weights are merged), so the decoder does not know which it
has (GRPO's sampling adds a third, the training window itself: train.grpo.WindowWeights):

- :class:`ResidentWeights`: every layer in its own device buffer, read once. What fits the
  device's memory (VRAM, or RAM on a CPU) runs this way.
- :class:`StreamedWeights`: for models larger than that. Decoder layers are read from the
  model's files for every forward pass into a ring of host staging buffers by a reader thread,
  ``slots - 1`` layers ahead of the compute, and copied into the K device slots of the training
  window (:class:`slideformer.engine.runtime.slots.SlotPool`). Every generated token pays one read of
  every layer, so it is slow (``slideformer chat`` reports the measured tok/s); the memory it
  needs is the embedding, the head and K layers, whatever the model's size.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterator

import torch

from slideformer.engine.models.spec import ModelSpec
from slideformer.engine.runtime.slots import SlotPool


def _read(reader, spec: ModelSpec, item: str, numel: int, dtype, alloc) -> torch.Tensor:
    """One item read into a new flat buffer of ``dtype`` made by ``alloc`` (the reader
    converts each tensor as it copies it in)."""
    return reader.read_item(spec, item, alloc(numel, dtype))


class ResidentWeights:
    """Every item in a device buffer of the compute dtype."""

    mode = "resident"

    def __init__(self, spec: ModelSpec, reader, dtype, backend):
        self.spec = spec
        alloc = backend.alloc
        self.embed_w = _read(reader, spec, "embed", spec.embed_layout.numel, dtype, alloc)
        self.layer_w = [_read(reader, spec, f"layer{i}", spec.layout(i).numel, dtype, alloc)
                        for i in range(spec.num_layers)]
        self.head_w = _read(reader, spec, "head", spec.head_layout.numel, dtype, alloc)
        self._views = [spec.layout(i).views(w) for i, w in enumerate(self.layer_w)]

    def layers(self) -> Iterator[dict]:
        """Each decoder layer's parameter views, layer 0 first."""
        yield from self._views

    def adapters(self, layer: int) -> None:
        return None

    def close(self) -> None:
        self.layer_w.clear()
        self._views.clear()


class StreamedWeights:
    """Embedding and head resident; decoder layers streamed through ``slots`` device slots."""

    mode = "streamed"

    def __init__(self, spec: ModelSpec, reader, dtype, backend, slots: int = 2):
        self.spec, self.reader, self.dtype, self.backend = spec, reader, dtype, backend
        self.k = max(2, min(slots, spec.num_layers))
        n = spec.params_per_layer
        self.embed_w = _read(reader, spec, "embed", spec.embed_layout.numel, dtype, backend.alloc)
        self.head_w = _read(reader, spec, "head", spec.head_layout.numel, dtype, backend.alloc)
        self.pool = SlotPool(backend, self.k, n, dtype, spec.num_layers)
        self.staging = [backend.host_alloc(n, dtype) for _ in range(self.k)]
        self.copied: list = [None] * self.k
        """The copy out of each staging buffer last started (the reader waits for it)."""
        self.reads: dict[int, Future] = {}
        self.reader_thread = ThreadPoolExecutor(1, "layer-reader")

    def _read_into(self, layer: int) -> torch.Tensor:
        """Reader thread: layer ``layer`` into its staging buffer once its last copy finished."""
        r = layer % self.k
        if self.copied[r] is not None:
            self.copied[r].wait()
        n = self.spec.layout(layer).numel
        return self.reader.read_item(self.spec, f"layer{layer}", self.staging[r][:n])

    def _request(self, layer: int) -> None:
        if layer < self.spec.num_layers and layer not in self.reads and not self.pool.has(layer):
            self.reads[layer] = self.reader_thread.submit(self._read_into, layer)

    def _start_copy(self, layer: int) -> None:
        if self.pool.has(layer):
            return
        host = self.reads.pop(layer).result()
        # the slot of the layer computing now is not to be taken
        self.copied[layer % self.k] = self.pool.start_load(layer, host, protect={layer - 1})

    def layers(self) -> Iterator[dict]:
        """Each decoder layer's parameter views in a device slot, layer 0 first.

        A layer's slot is given back when the caller asks for the next layer, so the views are
        valid until then.
        """
        spec, L = self.spec, self.spec.num_layers
        for j in range(min(self.k, L)):
            self._request(j)
        for i in range(L):
            self._start_copy(i)
            # the next layer's copy goes into the free slot while layer i computes
            if i + 1 < L and self.reads.get(i + 1) is not None and self.reads[i + 1].done():
                self._start_copy(i + 1)
            yield spec.layout(i).views(self.pool.acquire(i, spec.layout(i).numel))
            self.pool.release(i, evict=True)
            self._request(i + self.k)

    def adapters(self, layer: int) -> None:
        return None

    def close(self) -> None:
        self.reader_thread.shutdown(wait=True)
        self.reads.clear()
        for h in self.copied:  # the last copies out of the staging buffers
            if h is not None:
                h.wait()
        self.backend.release_host()  # unpin the staging buffers before they are freed
        self.staging.clear()
