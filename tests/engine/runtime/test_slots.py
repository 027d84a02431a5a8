"""The parameter-slot pool: residency of every layer, slot reuse, and the orderings it asks of the
backend (a copy into a slot waits for the compute that read its last occupant; compute waits for
the copy), checked against a backend that records every call."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.protocols import Backend
from slideformer.engine.runtime.slots import Residency, SlotPool


class Mark:
    """A distinct handle per call, so the test can tell which one a copy or a wait got."""

    def __init__(self, label: str):
        self.label = label

    def wait(self) -> None:
        pass

    def done(self) -> bool:
        return True

    def __repr__(self) -> str:
        return self.label


class RecordingBackend(CpuBackend):
    """The CPU backend (copies happen at once), recording copies, marks and compute waits."""

    def __init__(self):
        self.calls: list[tuple] = []
        self.n = 0

    def _handle(self, kind: str) -> Mark:
        self.n += 1
        return Mark(f"{kind}{self.n}")

    def start_h2d(self, dst, src, after=()):
        dst.copy_(src)
        h = self._handle("copy")
        h.start = h
        self.calls.append(("h2d", dst.data_ptr(), list(after), h))
        return h

    def mark(self):
        h = self._handle("mark")
        self.calls.append(("mark", h))
        return h

    def compute_waits(self, handle) -> None:
        self.calls.append(("compute_waits", handle))


def layer(i: int, n: int = 6) -> torch.Tensor:
    return torch.full((n,), float(i + 1))


def test_the_recording_backend_is_a_backend():
    assert isinstance(RecordingBackend(), Backend)


def test_a_layer_goes_on_host_loading_resident_and_back():
    pool = SlotPool(CpuBackend(), k=2, numel=6, dtype=torch.float32, num_layers=4)
    assert pool.k == 2 and pool.state == [Residency.ON_HOST] * 4
    pool.start_load(1, layer(1))
    assert pool.state[1] is Residency.LOADING and pool.has(1) and not pool.has(0)
    w = pool.acquire(1, 6)
    assert pool.state[1] is Residency.RESIDENT
    assert torch.equal(w, layer(1))
    pool.release(1, evict=False)  # stays for the next use
    assert pool.state[1] is Residency.RESIDENT and pool.has(1)
    pool.release(1, evict=True)
    assert pool.state[1] is Residency.ON_HOST and not pool.has(1)
    assert all(s.layer is None for s in pool.slots)


def test_loading_a_held_layer_copies_nothing_and_returns_its_copy():
    be = RecordingBackend()
    pool = SlotPool(be, k=2, numel=6, dtype=torch.float32, num_layers=3)
    first = pool.start_load(0, layer(0))
    assert pool.start_load(0, layer(0)) is first
    assert [c[0] for c in be.calls].count("h2d") == 1


def test_compute_waits_for_the_copy_before_using_a_slot():
    be = RecordingBackend()
    pool = SlotPool(be, k=1, numel=6, dtype=torch.float32, num_layers=2)
    copy = pool.start_load(0, layer(0))
    pool.acquire(0, 6)
    assert be.calls[-1] == ("compute_waits", copy)


def test_a_refill_waits_for_the_compute_on_the_previous_occupant():
    be = RecordingBackend()
    pool = SlotPool(be, k=1, numel=6, dtype=torch.float32, num_layers=3)
    pool.start_load(0, layer(0))
    pool.acquire(0, 6)
    pool.release(0, evict=True)
    read_0 = be.calls[-1][1]  # the mark release recorded
    pool.start_load(1, layer(1))
    kind, ptr, after, _ = be.calls[-1]
    assert kind == "h2d" and after == [read_0]
    assert ptr == pool.slots[0].buf.data_ptr()
    # the wait is consumed: the next refill waits only for compute on layer 1
    pool.acquire(1, 6)
    pool.release(1, evict=True)
    read_1 = be.calls[-1][1]
    pool.start_load(2, layer(2), after=["extra"])
    assert be.calls[-1][2] == ["extra", read_1]


def test_every_release_of_a_kept_layer_adds_a_wait():
    """A layer released twice without eviction (forward, then backward) holds its slot until
    both computes finished."""
    be = RecordingBackend()
    pool = SlotPool(be, k=1, numel=6, dtype=torch.float32, num_layers=2)
    pool.start_load(0, layer(0))
    pool.release(0, evict=False)
    fwd = be.calls[-1][1]
    pool.release(0, evict=True)
    bwd = be.calls[-1][1]
    pool.start_load(1, layer(1))
    assert be.calls[-1][2] == [fwd, bwd]


def test_a_full_pool_evicts_a_resident_layer_outside_protect():
    pool = SlotPool(CpuBackend(), k=2, numel=6, dtype=torch.float32, num_layers=4)
    for i in (0, 1):
        pool.start_load(i, layer(i))
        pool.release(i, evict=False)
    pool.start_load(2, layer(2), protect={0})
    assert pool.state[1] is Residency.ON_HOST and pool.has(0) and pool.has(2)
    assert torch.equal(pool.acquire(2, 6), layer(2))
    assert torch.equal(pool.acquire(0, 6), layer(0))  # untouched by the refill
    with pytest.raises(RuntimeError, match="no free parameter slot"):
        pool.start_load(3, layer(3), protect={0, 2})


def test_a_smaller_layer_uses_the_front_of_its_slot():
    pool = SlotPool(CpuBackend(), k=1, numel=8, dtype=torch.float32, num_layers=2)
    pool.start_load(0, layer(0, n=8))
    pool.release(0, evict=True)
    pool.start_load(1, layer(1, n=5))
    w = pool.acquire(1, 5)
    assert w.numel() == 5 and torch.equal(w, layer(1, n=5))
    assert w.data_ptr() == pool.slots[0].buf.data_ptr()


def test_invalidate_all_evicts_every_layer():
    pool = SlotPool(CpuBackend(), k=3, numel=6, dtype=torch.float32, num_layers=5)
    for i in (0, 2, 4):
        pool.start_load(i, layer(i))
    pool.acquire(2, 6)
    pool.invalidate_all()
    assert pool.state == [Residency.ON_HOST] * 5 and not pool.where
    assert all(s.layer is None and len(s.free_after) == 1 for s in pool.slots)
