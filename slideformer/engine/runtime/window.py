"""The window items as the executor sees them: one object per item and its state in flight.

Items are the embedding, the decoder layers and the head, in update order (embed, 0 .. L-1,
head). Each :class:`WindowItem` holds, for one item, where its state lives (the host item, its
device-updated state, its adapters) and what is in flight for it (its update, the copies of its
gradient to the host, whether its resident device weights are stale). Which slot holds a decoder
layer's weights is the slot pool's (runtime.slots): one table owns residency.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Iterable

import torch

from slideformer.engine.runtime.host_state import DeviceItem, HostItem
from slideformer.engine.runtime.lora import FrozenItem, adapter_name
from slideformer.engine.runtime.protocols import Backend, Handle


@dataclass(eq=False)
class WindowItem:
    """One window item and what is in flight for it."""

    name: str
    """``embed``, ``layer{i}`` or ``head`` (the host state's key, the timeline's label)."""
    layer: int | None
    """Decoder layer index; None for the embedding and the head."""
    host: HostItem | FrozenItem
    """Its host state: what checkpoints read and the CPU update refreshes."""
    device: DeviceItem | None = None
    """Its optimizer state in VRAM when it is updated on the device, else None."""
    adapter: DeviceItem | None = None
    """Its LoRA adapters' state (trained on the device over a frozen base), else None."""
    resident: torch.Tensor | None = None
    """Device weights held for the whole run (the embedding and the head); None: a slot's."""
    grad: torch.Tensor | None = None
    """Device fp32 gradient of a resident item (None: frozen, or a decoder layer)."""
    stale: bool = True
    """The resident weights are older than the host's (an update ran since the last copy)."""
    update: Future | None = None
    """Its update in flight: the next use of its host weights waits for it."""
    grads_out: list[Handle] = field(default_factory=list)
    """Copies of its gradient (and squared norm) to the host: its update waits for them."""

    @property
    def on_device(self) -> bool:
        """Updated on the device (no host update, no gradient copy)."""
        return self.device is not None

    def device_states(self) -> list[DeviceItem]:
        """The state it trains on the device (its own, or its adapters')."""
        return [d for d in (self.device, self.adapter) if d is not None]


def build_items(host: dict[str, HostItem | FrozenItem], num_layers: int, backend: Backend,
                resident: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                device_update: bool, device_layers: int, lora: bool) -> list[WindowItem]:
    """The items in update order, with the device state of those updated on the device.

    ``resident``: the device weights and gradient the executor holds for ``embed`` and
    ``head``; ``device_update``: those two are updated on the device; ``device_layers``: so are
    decoder layers 0 .. device_layers-1; ``lora``: every layer trains its adapters there.
    """
    if lora and (device_layers or device_update):
        raise ValueError("a frozen base has no device-updated base items")
    items = [WindowItem("embed", None, host["embed"])]
    items += [WindowItem(f"layer{i}", i, host[f"layer{i}"]) for i in range(num_layers)]
    items.append(WindowItem("head", None, host["head"]))
    for item in items:
        if item.layer is None:
            item.resident, item.grad = resident[item.name]
            if device_update:
                item.device = DeviceItem(item.host, backend.alloc, item.resident, item.grad)
        elif item.layer < device_layers:
            item.device = DeviceItem(item.host, backend.alloc)
        elif lora:
            item.adapter = DeviceItem(host[adapter_name(item.layer)], backend.alloc)
    return items


def prefetch_disk(items: Iterable[WindowItem], tl) -> None:
    """Start reading the moments of the disk items among ``items`` (in update order)."""
    for item in items:
        if item.host.disk is not None:
            item.host.disk.prefetch(tl)
