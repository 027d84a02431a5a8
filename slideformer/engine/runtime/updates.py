"""The host items' CPU AdamW updates, run in one worker thread (DESIGN §3.4).

The executor decides when an item's update may start; :class:`HostUpdates` runs it: it waits
for the copies of the item's gradient, reads its moments from the disk tier when it has a file
there, updates, and writes them behind. Three ways an update starts:

    at once     without clipping, as soon as a layer's gradient leaves the device, behind a
                :class:`Guard` that skips it (and every later one of the step) once a gradient
                or the loss is not finite
    speculative with exact clipping, the last host layers update with coefficient 1 during the
                backward, keeping their pre-update state (runtime.grad_ring.Speculation), settled
                at the barrier: kept when the coefficient is 1, redone from the snapshot otherwise
    barrier     with clipping, every other update, once the global norm is known

The worker is a single thread under CUDA (updates overlap the device) and runs each update at
once on the CPU backend (deterministic, same calls). Under CUDA it takes the queued updates in
submission order, except at the barrier: then the speculative updates still queued (the CPU
falls behind the backward) and the barrier's own are taken in the order the next forward needs
them (:class:`OrderedWorker`), so the forward's first host layer does not wait behind the
speculative updates of layers it reaches later. Each item's own updates keep their order.
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from concurrent.futures import Future

import torch

from slideformer.engine.runtime.grad_ring import Speculation
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, adam_update
from slideformer.engine.runtime.protocols import Backend
from slideformer.engine.runtime.timeline import StepTimeline
from slideformer.engine.runtime.window import WindowItem


class Guard:
    """Without clipping, whether a step's layer updates may still run.

    Each layer's update first reads the step's loss and that layer's squared gradient norm
    (copied to the host behind its gradients); the first non-finite one stops it and every
    later update of the step, so a non-finite loss skips the whole step and a gradient
    overflow keeps every layer from the faulty one down unchanged.
    """

    def __init__(self, values: torch.Tensor):
        self.values = values
        """Host copy: squared gradient norm per layer, then the loss."""
        self.bad = False
        self.applied = 0

    @classmethod
    def watch(cls, backend: Backend, loss: torch.Tensor, health: torch.Tensor,
              health_host: torch.Tensor) -> "Guard":
        """The guard of a step: ``health`` (per layer, then the loss) on the device, copied to
        ``health_host`` behind each layer's gradient; the loss's copy starts here."""
        health[-1:].copy_(loss.reshape(1))
        backend.start_d2h(health_host[-1:], health[-1:], after=[backend.mark()])
        return cls(health_host)

    def allows(self, layer: int) -> bool:
        self.bad = self.bad or not (math.isfinite(float(self.values[layer]))
                                    and math.isfinite(float(self.values[-1])))
        return not self.bad


class Sync:
    """Runs submitted work at once (CPU backend): deterministic, same interface as a pool."""

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        f.set_result(fn(*args))
        return f

    def shutdown(self) -> None:
        pass


class OrderedWorker:
    """One worker thread: queued work runs in submission order until :meth:`prioritise`, which
    reorders what is still queued by each entry's ``order`` (ties and entries without one in
    submission order); work submitted after that runs after all of it."""

    def __init__(self, name: str = "cpu-adam"):
        self._queue: list[list] = []  # heap of [key, fn, args, future]
        self._cv = threading.Condition()
        self._seq = itertools.count()
        self._epoch = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn, *args, order: float = 0.0) -> Future:
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the update worker is shut down")
            seq = next(self._seq)
            heapq.heappush(self._queue, [(self._epoch, 0.0, seq), fn, args, fut, order])
            self._cv.notify()
        return fut

    def prioritise(self) -> None:
        """What is queued now runs by its ``order``, before anything submitted later."""
        with self._cv:
            for entry in self._queue:
                epoch, _, seq = entry[0]
                if epoch == self._epoch:
                    entry[0] = (epoch, entry[4], seq)
            heapq.heapify(self._queue)
            self._epoch += 1

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                _, fn, args, fut, _ = heapq.heappop(self._queue)
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # the waiter re-raises it
                    fut.set_exception(e)

    def shutdown(self) -> None:
        """Run what is queued, then stop."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join()


class HostUpdates:
    """Submits and settles the CPU updates of the host items.

    ``norms``: the host copy of each layer's squared gradient norm (what the speculative
    heuristic reads); ``snapshots``: the speculative layers' snapshots; ``group``: the ranks of
    a data-parallel run (each updates its own slice of every item, slideformer.engine.dist).
    """

    def __init__(self, threaded: bool, snapshots: Speculation, norms: torch.Tensor,
                 num_layers: int, group):
        self.pool = OrderedWorker() if threaded else Sync()
        """Runs the updates (one thread: an item's updates stay in submission order)."""
        self.workspace = AdamWorkspace()
        self.snapshots, self.norms, self.num_layers = snapshots, norms, num_layers
        self.group = group
        self.submitted = 0
        """Updates submitted by the current step so far (0 until its updates may start)."""
        self.speculated: list[int] = []
        """Layers of the current step whose speculative update was submitted."""
        self.limit_sq = 0.0
        """The step's squared clipping threshold."""

    def start_step(self, max_grad_norm: float) -> None:
        self.submitted = 0
        self.speculated = []
        self.limit_sq = max_grad_norm ** 2

    def submit(self, item: WindowItem, hp: AdamHyper, tl: StepTimeline, guard: Guard | None = None,
               grad: torch.Tensor | None = None, speculative: bool = False) -> None:
        """Queue the item's update (``grad``: where its gradient landed, default its own).

        ``speculative``: snapshot the layer first; the update is undone if the step is (so it
        does not count among the step's applied updates).
        """
        if item.resident is not None:
            item.stale = True
        self.submitted += not speculative
        if speculative:
            self.speculated.append(item.layer)
        item.update = self._submit(item, self._run, item, item.grads_out, hp, tl, guard, grad,
                                   speculative)

    def _submit(self, item: WindowItem, fn, *args) -> Future:
        """Queue ``fn``; with an OrderedWorker, tagged with the item's place in the forward
        (the embedding first, the head last)."""
        if not isinstance(self.pool, OrderedWorker):
            return self.pool.submit(fn, *args)
        order = -1 if item.layer is None and item.name == "embed" else (
            self.num_layers if item.layer is None else item.layer)
        return self.pool.submit(fn, *args, order=order)

    def at_barrier(self, item: WindowItem, hp: AdamHyper, coef: float, tl: StepTimeline) -> None:
        """The item's update once the norm is known; a speculative layer's update stands when
        the coefficient is 1 and is redone from its snapshot otherwise."""
        if item.layer not in self.speculated:
            self.submit(item, hp, tl)
        else:
            item.update = self._submit(item, self._settle, item, item.update, hp, coef, tl)

    def settled(self) -> None:
        """The barrier updates are queued: the speculative ones are this step's updates now,
        and what is still queued runs in the next forward's order."""
        self.speculated = []
        if isinstance(self.pool, OrderedWorker):
            self.pool.prioritise()

    def wait(self, item: WindowItem) -> None:
        """Block until the item's update in flight (if any) finished."""
        fut, item.update = item.update, None
        if fut is not None:
            fut.result()

    def roll_back(self, items: list[WindowItem]) -> None:
        """Drop the current step: wait for its updates, undo its speculative ones."""
        for item in items:
            if item.update is not None:
                item.update.result()
        for item in items:
            item.update = None
        hosts = {item.layer: item.host for item in items}
        for layer in self.speculated:
            if self.snapshots.take(layer):
                self.snapshots.restore(layer, hosts[layer])
        self.speculated = []

    def shutdown(self) -> None:
        self.pool.shutdown()

    # ---- in the worker thread ----------------------------------------------------------------
    def _run(self, item: WindowItem, handles, hp: AdamHyper, tl: StepTimeline,
             guard: Guard | None, grad: torch.Tensor | None, speculative: bool) -> None:
        for h in handles:
            h.wait()
        if guard is not None and not guard.allows(item.layer):
            return
        host = self.group.owned(item.host)
        grad = None if grad is None else grad[self.group.span(grad.numel())]
        staged = None if host.disk is None else host.disk.acquire(tl)
        try:
            t0 = time.perf_counter()
            if speculative and not self._may_speculate(item.layer):
                return
            if speculative:
                self.snapshots.update(item.layer, host, lambda out: adam_update(
                    host, hp, self.workspace, grad=grad, out=out))
            else:
                adam_update(host, hp, self.workspace, staged=staged, grad=grad)
            tl.host_span("optimizer", item.name, t0, time.perf_counter())
        finally:
            if host.disk is not None:
                host.disk.release(True, tl)
        if guard is not None:
            guard.applied += 1

    def _may_speculate(self, layer: int) -> bool:
        """False once the squared gradient norms of the head and of layers L-1 .. ``layer`` (on
        the host behind their gradients; the head's last, copied before the layers' backward)
        already exceed the limit: the coefficient will be below 1, so an update with 1 would be
        wasted work (a heuristic only: the barrier settles it exactly). Disjoint parameters'
        final norms: their sum never exceeds the step's."""
        partial = float(self.norms[layer:self.num_layers + 1].sum())
        return not (partial > self.limit_sq)

    def _settle(self, item: WindowItem, speculative: Future, hp: AdamHyper, coef: float,
                tl: StepTimeline) -> None:
        """At the barrier: keep a speculative update made with the right coefficient, else
        redo it from the snapshot; a layer that did not speculate updates now."""
        speculative.result()  # queued before this for the same item: already done
        layer, host = item.layer, item.host
        saved = self.snapshots.take(layer)
        if saved and coef == 1.0:
            return
        t0 = time.perf_counter()
        if saved:
            self.snapshots.restore(layer, host)
        adam_update(host, hp, self.workspace, grad=self.snapshots.grad(layer, host.numel))
        tl.host_span("optimizer", item.name, t0, time.perf_counter())
