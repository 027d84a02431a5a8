"""Host state of frozen-base training (train.method = lora / qlora; DESIGN §9).

A frozen item (the embedding, a decoder layer, the head) holds its weights only: no remainder,
no gradient, no moments. It still streams through the executor's slots like a trained layer.
The adapters of decoder layer i are a small trained item ``lora{i}`` (an ordinary
:class:`HostItem`: exact master + AdamW moments), which the executor keeps and updates on the
device; the host copy is what checkpoints and the export read.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from slideformer.engine.models.lora import LoraSpec, adapter_layout, init_adapter
from slideformer.engine.models.spec import Layout, ModelSpec
from slideformer.engine.runtime.host_state import HostItem
from slideformer.engine.runtime.nf4 import Nf4Layout


class FrozenItem:
    """Weights of an item that is never updated (the executor reads ``w`` only).

    ``nf4``: ``w`` holds the item quantised (slideformer.engine.runtime.nf4: its matrices in NF4, the 1-D
    tensors in ``dtype``); it is quantised as it is set, one item at a time while loading.
    ``tier``: an NVMe tier (slideformer.engine.runtime.nvme) that holds the weights of the layers it
    chose: ``w`` is then None and the bytes live in the item's file, written once
    while loading (:meth:`stored`) and read through the tier's staging buffers
    (:class:`BaseReader`).
    """

    def __init__(self, name: str, layout: Layout, dtype: torch.dtype, alloc_pinned,
                 nf4: bool = False, tier=None):
        self.name, self.layout, self.numel = name, layout, layout.numel
        self.quant = Nf4Layout.build(layout, dtype) if nf4 else None
        """The byte layout of ``w`` when quantised, else None."""
        size, stored = (self.quant.nbytes, torch.uint8) if nf4 else (self.numel, dtype)
        self.disk = None if tier is None else tier.place(name, size, {"w": stored})
        """The item's file in the NVMe tier (field ``w``); None: the weights are in RAM."""
        self.w = alloc_pinned(size, stored) if self.disk is None else None
        self.g = None

    @contextmanager
    def stored(self, write: bool) -> Iterator[torch.Tensor]:
        """The stored weights ``w`` for the block: in RAM, or for an item on disk in a staging
        buffer of its file (written to the file after the block if ``write``; the buffer's read
        of a file not yet written is of unwritten extents, so it costs no disk traffic)."""
        if self.disk is None:
            yield self.w
        else:
            with self.disk.staged(write) as staged:
                yield staged["w"]

    def set_master(self, master: torch.Tensor) -> None:
        with self.stored(write=True) as w:
            if self.quant is None:
                w.copy_(master)
            else:
                self.quant.quantize(master, w)

    def master(self) -> torch.Tensor:
        """The weights as fp32 (a new tensor; dequantised if quantised; read if on disk)."""
        with self.stored(write=False) as w:
            return self._unpack(w)

    def _unpack(self, w: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return w.to(torch.float32, copy=True)
        return self.quant.dequantize(w, torch.empty(self.numel, dtype=torch.float32))


class BaseReader:
    """Copies of frozen layers from the NVMe tier's staging buffers into the device's slots.

    The executor asks for a step's loads in the order it issues them (:meth:`read_ahead`:
    the forward's layers ascending, the backward's descending, only those not already in a slot),
    so the tier reads them in that order as its staging buffers free up. A staging buffer goes
    back to the tier once its copy to the device finished (the copy is asynchronous under
    CUDA); all but one of the tier's buffers at most wait for their copies, so the tier always
    has one to read the next layer into. Layers in RAM are copied from ``w`` as before.
    """

    def __init__(self):
        self._copies: list[tuple[FrozenItem, object]] = []
        """(item, its copy's handle): staging buffers in use by a copy to the device."""

    @staticmethod
    def read_ahead(items, tl=None) -> None:
        """Start reading the weights of the items among ``items`` that have them on disk, in
        the order given."""
        for item in items:
            if item.w is None:
                item.disk.prefetch(tl)

    def start_load(self, pool, layer: int, item, tl=None):
        """Copy ``item``'s weights (a host item of any kind) into a slot of ``pool``; returns
        the copy's handle."""
        if item.w is not None:
            return pool.start_load(layer, item.w)
        held = max(1, item.disk.buffers - 1)  # one buffer stays free for the next read
        self._free(held - 1)
        h = pool.start_load(layer, item.disk.acquire(tl)["w"])
        self._copies.append((item, h))
        self._free(held, wait=False)
        return h

    def _free(self, keep: int, wait: bool = True) -> None:
        """Give back the staging buffers whose copies finished, waiting for the oldest while
        more than ``keep`` are held (``wait``: False gives back only finished ones)."""
        while self._copies:
            item, h = self._copies[0]
            if not h.done():
                if not wait or len(self._copies) <= keep:
                    return
                h.wait()
            self._copies.pop(0)
            item.disk.release(write=False)

    def settle(self) -> None:
        """Wait for every copy out of a staging buffer and give the buffers back."""
        self._free(0)


def adapter_name(layer: int) -> str:
    return f"lora{layer}"


def is_adapter(name: str) -> bool:
    return name.startswith("lora")


def build_adapters(spec: ModelSpec, lora: LoraSpec, backend, compute_dtype: torch.dtype,
                   moments_dtype: torch.dtype) -> dict[str, HostItem]:
    """One trained item per decoder layer (zero moments; weights from :func:`init_adapters`)."""
    return {adapter_name(i): HostItem(adapter_name(i), adapter_layout(spec, lora, i),
                                      compute_dtype, moments_dtype,
                                      backend.host_alloc, _zeros, grad=False)
            for i in range(spec.num_layers)}


def init_adapters(adapters: dict[str, HostItem], seed: int) -> None:
    """PEFT's default init of every adapter, reproducible from ``seed``, layer by layer."""
    g = torch.Generator().manual_seed(seed)
    for item in adapters.values():
        item.set_master(init_adapter(item.layout, torch.empty(item.numel), g))


def _zeros(numel: int, dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)
