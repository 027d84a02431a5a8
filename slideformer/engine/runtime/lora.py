"""Host state of frozen-base training (train.method = lora / qlora; DESIGN §9).

A frozen item (the embedding, a decoder layer, the head) holds its weights only: no remainder,
no gradient, no moments. It still streams through the executor's slots like a trained layer.
The adapters of decoder layer i are a small trained item ``lora{i}`` (an ordinary
:class:`HostItem`: exact master + AdamW moments), which the executor keeps and updates on the
device; the host copy is what checkpoints and the export read.
"""
from __future__ import annotations

import torch

from slideformer.engine.models.lora import LoraSpec, adapter_layout, init_adapter
from slideformer.engine.models.spec import Layout, ModelSpec
from slideformer.engine.runtime.host_state import HostItem
from slideformer.engine.runtime.nf4 import Nf4Layout


class FrozenItem:
    """Weights of an item that is never updated (the executor reads ``w`` only).

    ``nf4``: ``w`` holds the item quantised (slideformer.engine.runtime.nf4: its matrices in NF4, the 1-D
    tensors in ``dtype``); it is quantised as it is set, one item at a time while loading.
    """

    def __init__(self, name: str, layout: Layout, dtype: torch.dtype, alloc_pinned,
                 nf4: bool = False):
        self.name, self.layout, self.numel = name, layout, layout.numel
        self.quant = Nf4Layout.build(layout, dtype) if nf4 else None
        """The byte layout of ``w`` when quantised, else None."""
        self.w = alloc_pinned(self.quant.nbytes, torch.uint8) if nf4 else alloc_pinned(self.numel, dtype)
        self.g = None
        self.disk = None
        """Never in the NVMe tier (it has no optimizer state)."""

    def set_master(self, master: torch.Tensor) -> None:
        if self.quant is None:
            self.w.copy_(master)
        else:
            self.quant.quantize(master, self.w)

    def master(self) -> torch.Tensor:
        """The weights as fp32 (a new tensor; dequantised if quantised)."""
        if self.quant is None:
            return self.w.to(torch.float32, copy=True)
        return self.quant.dequantize(self.w, torch.empty(self.numel, dtype=torch.float32))


def adapter_name(layer: int) -> str:
    return f"lora{layer}"


def is_adapter(name: str) -> bool:
    return name.startswith("lora")


def build_adapters(spec: ModelSpec, lora: LoraSpec, backend, compute_dtype: torch.dtype,
                   moments_dtype: torch.dtype) -> dict[str, HostItem]:
    """One trained item per decoder layer (zero moments; weights from :func:`init_adapters`)."""
    layout = adapter_layout(spec, lora)
    return {adapter_name(i): HostItem(adapter_name(i), layout, compute_dtype, moments_dtype,
                                      backend.host_alloc, _zeros, grad=False)
            for i in range(spec.num_layers)}


def init_adapters(adapters: dict[str, HostItem], seed: int) -> None:
    """PEFT's default init of every adapter, reproducible from ``seed``, layer by layer."""
    g = torch.Generator().manual_seed(seed)
    for item in adapters.values():
        item.set_master(init_adapter(item.layout, torch.empty(item.numel), g))


def _zeros(numel: int, dtype) -> torch.Tensor:
    return torch.zeros(numel, dtype=dtype)
