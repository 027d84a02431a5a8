"""The GPU parameter-slot pool and its layer residency state machine.

K slots, each one flat buffer the size of the largest decoder layer, allocated once. One object
owns the residency of every layer::

    ON_HOST --start_load--> LOADING --(copy done)--> RESIDENT --release--> ON_HOST
                                        (slot reusable once compute on it finished)

A slot is reused only after the compute that read its previous occupant finished (a compute
mark recorded at release), and a layer is used only after its copy finished (the compute stream
waits on the copy's event), so no host-side synchronisation is needed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


class Residency(enum.Enum):
    ON_HOST = "on_host"
    LOADING = "loading"
    RESIDENT = "resident"


@dataclass
class Slot:
    buf: torch.Tensor
    layer: int | None = None
    loaded: object = None
    """Handle of the copy that filled it."""
    free_after: list = field(default_factory=list)
    """Handles of compute that must finish before the buffer is overwritten."""


class SlotPool:
    """K parameter slots on the device and which layer each holds."""

    def __init__(self, backend, k: int, numel: int, dtype: torch.dtype, num_layers: int):
        self.backend = backend
        self.slots = [Slot(backend.alloc(numel, dtype)) for _ in range(k)]
        self.state = [Residency.ON_HOST] * num_layers
        self.where: dict[int, Slot] = {}

    @property
    def k(self) -> int:
        return len(self.slots)

    def has(self, layer: int) -> bool:
        return self.state[layer] is not Residency.ON_HOST

    def keep_only(self, layers) -> None:
        """Free the slots holding layers outside ``layers`` (a forward pass about to start
        needs only its first layers; what a forward left in slots is its last ones, which its
        first loads would otherwise have to evict one by one, perhaps the one just loaded).
        Their pending compute marks stay with the slots."""
        keep = set(layers)
        for s in self.slots:
            if s.layer is not None and s.layer not in keep:
                self.state[s.layer] = Residency.ON_HOST
                del self.where[s.layer]
                s.layer = None

    def _free_slot(self, protect: set[int]) -> Slot:
        for s in self.slots:
            if s.layer is None:
                return s
        for s in self.slots:  # evict a resident layer that is not needed soon
            if s.layer not in protect:
                self.state[s.layer] = Residency.ON_HOST
                del self.where[s.layer]
                s.layer = None
                return s
        raise RuntimeError("no free parameter slot (schedule bug)")

    def start_load(self, layer: int, host_w: torch.Tensor, after=(), protect: set[int] = frozenset()):
        """Begin copying a layer's weights into a slot; returns the copy handle."""
        if self.has(layer):
            return self.where[layer].loaded
        slot = self._free_slot(set(protect))
        handle = self.backend.start_h2d(slot.buf[:host_w.numel()], host_w,
                                        after=list(after) + slot.free_after)
        slot.layer, slot.loaded, slot.free_after = layer, handle, []
        self.state[layer] = Residency.LOADING
        self.where[layer] = slot
        return handle

    def acquire(self, layer: int, numel: int) -> torch.Tensor:
        """The layer's device weights; the compute stream waits for the copy."""
        slot = self.where[layer]
        self.backend.compute_waits(slot.loaded)
        self.state[layer] = Residency.RESIDENT
        return slot.buf[:numel]

    def release(self, layer: int, evict: bool) -> None:
        """Compute issued on the layer so far must finish before its slot is refilled."""
        slot = self.where[layer]
        slot.free_after.append(self.backend.mark())
        if evict:
            self.state[layer] = Residency.ON_HOST
            del self.where[layer]
            slot.layer = None

    def invalidate_all(self) -> None:
        """Weights changed on the host (after an update): every copy is stale."""
        for layer in list(self.where):
            self.release(layer, evict=True)
