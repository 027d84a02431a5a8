"""Host gradient buffers that decoder layers borrow, and the speculative updates of exact clipping.

Without clipping a layer's gradient is dead once its update ran, and that update starts as soon
as the gradient lands, so the layers share a :class:`GradRing` of a few buffers: the copy into a
buffer waits for the update that last read it.

With exact global-norm clipping the coefficient ``c = min(1, max_norm / (norm + 1e-6))`` is known
only when the backward ends (the barrier). :class:`Speculation` lets the last ``depth`` decoder
layers updated on the host (the first ones the backward finishes) update at once anyway, with
``c = 1``, overlapping the rest of the backward. Each speculative layer has a second set of
state buffers (w, rem, m, v: its snapshot) and a gradient buffer there (the layer owns none).
Its update reads the layer's state and writes the new state into the snapshot's buffers; the
two sets then trade places, so the layer holds the new state and the snapshot its pre-update
state, bit for bit, with no copy (the update moves the bytes an update in place moves). At the
barrier:

    c == 1      the speculative call was ``adam_update(state, g, hyper(1.0))``: the very call the
                barrier mode makes, on the same state and gradient; nothing is left to do
    c < 1       restore the snapshot (the sets trade places back), then ``adam_update(state, g,
                hyper(c))``: the barrier mode's call again. A restart is needed, not a rescale:
                AdamW's moments see c * g and c^2 * g^2, so the update is not linear in c
    skipped     (non-finite loss or norm) restore the snapshot: the weights stay unchanged

The update reads its gradient and never writes it (coefficient 1 passes no scale), so the
repair sees the gradient the speculative update saw; the state is restored bit for bit; the
hyper-parameters are the barrier's. Every layer therefore ends each step with the barrier
mode's bits. Layers beyond the window, on the device or in the NVMe tier keep the barrier.

The sets trade places while nothing reads them: a layer's weights are copied to the device
before its backward, its update follows its gradient, and the next read (the next step's
forward) waits for the update; both weight buffers are page-locked, as the device copies need.

Memory: a snapshot holds a layer's weights, remainder and moments plus its gradient (12 B per
parameter more than the barrier's gradient buffer for fp32 moments and bf16 weights: 16 B
instead of 4), so the planner picks how many layers speculate from host RAM
(ExecShape.spec_layers).
"""
from __future__ import annotations

from concurrent.futures import Future

import torch


class GradRing:
    """``size`` gradient buffers of ``numel`` fp32 values, handed out in turn."""

    def __init__(self, host_alloc, size: int, numel: int):
        self.bufs = [host_alloc(numel, torch.float32) for _ in range(size)]
        self.user: list[Future | None] = [None] * size
        """The update that reads each buffer last (the next copy into it waits for it)."""
        self.next = 0

    def take(self, n: int) -> tuple[int, torch.Tensor]:
        """The next buffer (first n values), once the update that last read it finished."""
        r, self.next = self.next, (self.next + 1) % len(self.bufs)
        if self.user[r] is not None:
            self.user[r].result()
        return r, self.bufs[r][:n]

    def used_by(self, r: int, update: Future) -> None:
        self.user[r] = update


class _Snapshot:
    """One layer's second state buffers and its gradient."""

    def __init__(self, item, host_alloc, alloc):
        self.g = host_alloc(item.numel, torch.float32)
        self.w = host_alloc(item.numel, item.w.dtype)  # the layer's weights when the sets trade
        self.rem = None if item.rem is None else alloc(item.numel, item.rem.dtype)
        self.m, self.v = alloc(item.m.numel(), item.m.dtype), alloc(item.v.numel(), item.v.dtype)
        self.saved = False
        """This step's speculative update ran (the snapshot holds its pre-update state)."""

    def trade(self, item) -> None:
        """The layer takes these buffers and this snapshot the layer's."""
        for k in ("w", "rem", "m", "v"):
            mine, theirs = getattr(self, k), getattr(item, k)
            setattr(self, k, theirs)
            setattr(item, k, mine)


class Speculation:
    """Snapshots of the speculative layers (see the module docstring); ``layers`` from
    :func:`speculative_layers`."""

    def __init__(self, host: dict, layers: list[int], host_alloc, alloc):
        self.snaps = {i: _Snapshot(host[f"layer{i}"], host_alloc, alloc) for i in layers}

    def __contains__(self, layer: int) -> bool:
        return layer in self.snaps

    def grad(self, layer: int, n: int) -> torch.Tensor:
        """Where the layer's gradient lands (kept until the barrier)."""
        return self.snaps[layer].g[:n]

    def update(self, layer: int, item, update) -> None:
        """Run ``update(out=snapshot)`` (in the update's thread): it writes the layer's new
        state into the snapshot's buffers, which the layer then takes in exchange for its own."""
        snap = self.snaps[layer]
        update(out=snap)
        snap.trade(item)
        snap.saved = True

    def take(self, layer: int) -> bool:
        """Whether this step's speculative update of the layer ran; the step's snapshot is
        consumed (the next step's update saves a new one)."""
        saved, self.snaps[layer].saved = self.snaps[layer].saved, False
        return saved

    def restore(self, layer: int, item) -> None:
        """Give the layer back the state it had before :meth:`update` (call once that update
        finished)."""
        self.snaps[layer].trade(item)

    def buffers(self) -> list[torch.Tensor]:
        """Every tensor the snapshots hold (for the planner's memory rows)."""
        return [t for s in self.snaps.values() for t in (s.g, s.w, s.rem, s.m, s.v) if t is not None]
