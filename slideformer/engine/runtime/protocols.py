"""What the runtime needs from a transfer backend and from a disk tier, as typed protocols.

The executor, the slot pool, the activation stores and the timeline talk to a :class:`Backend`
(runtime.backend: ``CudaBackend`` with its streams, ``CpuBackend`` that does each copy at
once). Host items and the executor talk to a :class:`DiskTier` and the :class:`DiskFile` it
places per item (runtime.nvme: ``NvmeTier``). Nothing here imports an implementation, so a
new backend or tier is checked against the calls the runtime makes, not against a base class.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, Sequence, runtime_checkable

import torch


@runtime_checkable
class Handle(Protocol):
    """Async work already issued: the host may block on it or ask whether it finished."""

    def wait(self) -> None:
        """Block the host until the work finished."""

    def done(self) -> bool:
        """Whether the work finished (never blocks)."""


@runtime_checkable
class CopyHandle(Handle, Protocol):
    """The end of a copy; ``start`` marks its beginning (for the step timeline)."""

    start: Handle


@runtime_checkable
class Backend(Protocol):
    """Buffers, copies and ordering on one compute device (DESIGN §3.3, STYLE 7).

    Copies run host->device and device->host on their own queues; ``after`` handles must
    complete before a copy starts, and ``compute_waits`` orders the compute stream after a
    handle without blocking the host.
    """

    device: torch.device
    """Where ``alloc`` puts tensors and compute runs."""
    is_cuda: bool
    """Copies and compute are asynchronous (updates then run in a worker thread)."""

    def alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed device tensor."""

    def host_alloc(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor that copies can use directly (page-locked under CUDA)."""

    def start_h2d(self, dst: torch.Tensor, src: torch.Tensor,
                  after: Sequence[Handle] = ()) -> CopyHandle:
        """Begin copying host ``src`` into device ``dst``."""

    def start_d2h(self, dst: torch.Tensor, src: torch.Tensor,
                  after: Sequence[Handle] = ()) -> CopyHandle:
        """Begin copying device ``src`` into host ``dst``."""

    def mark(self) -> Handle:
        """A point on the compute stream (everything issued so far)."""

    def compute_waits(self, handle: Handle) -> None:
        """The compute stream waits for ``handle``; the host does not."""

    def keep_alive(self, tensor: torch.Tensor) -> None:
        """A compute-stream tensor is read by a copy queue: keep its memory until then."""

    def pin_mapping(self, buf) -> None:
        """Page-lock a host mapping (an mmap) for copies until ``release_host`` (no-op: CPU)."""

    def release_host(self) -> None:
        """Give back what ``host_alloc`` and ``pin_mapping`` locked (before they are freed)."""

    def peak_memory(self) -> int | None:
        """Peak device bytes reserved since the last reset (None: not measured)."""

    def reset_peak(self) -> None:
        """Start a new peak measurement."""


@runtime_checkable
class DiskFile(Protocol):
    """One item's fields (moments, maybe the remainder; a frozen item's weights) in a disk tier,
    and its staging calls.

    ``prefetch`` reads ahead; ``acquire`` hands the fields in a staging buffer (reading them if
    needed) and ``release`` gives it back, written behind if ``write``. A thread holds fewer
    items at a time than the tier has ``buffers`` (the optimizer one, the frozen base's reader
    those whose copies to the device are in flight).
    """

    name: str
    """The item's name (``layer{i}``)."""
    fields: tuple[str, ...]
    """The fields it holds instead of RAM: of ``rem``, ``m``, ``v`` (trained), ``w`` (frozen)."""
    buffers: int
    """Staging buffers of its tier: a thread holding several items keeps fewer than this."""

    def prefetch(self, tl=None) -> None:
        """Start reading the fields ahead of :meth:`acquire` (spans go to timeline ``tl``)."""

    def acquire(self, tl=None) -> dict[str, torch.Tensor]:
        """The fields, in a staging buffer, once read."""

    def release(self, write: bool, tl=None) -> None:
        """Done with the staging buffer; ``write``: write the fields back first."""

    def flush(self) -> None:
        """Wait for the item's writes in flight."""

    def mapped(self) -> dict[str, torch.Tensor]:
        """The fields as tensors over the file itself (checkpoints; no update running)."""

    def staged(self, write: bool) -> AbstractContextManager[dict[str, torch.Tensor]]:
        """:meth:`acquire` and :meth:`release` around a block."""


@runtime_checkable
class DiskTier(Protocol):
    """Where chosen items keep fields on disk; the rest keep them in RAM."""

    def place(self, name: str, numel: int, fields: dict[str, torch.dtype]) -> DiskFile | None:
        """The item's file if the tier holds ``name``, else None (all its fields stay in RAM)."""
