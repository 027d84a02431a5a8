"""The update worker: submission order, reordered at the barrier by the next forward's order."""
from __future__ import annotations

import threading

import pytest

from slideformer.engine.runtime.updates import OrderedWorker


def _held(worker: OrderedWorker) -> threading.Event:
    """Keep the worker busy until the returned event is set (so work queues behind it)."""
    go, started = threading.Event(), threading.Event()
    worker.submit(lambda: (started.set(), go.wait()))
    started.wait()
    return go


def test_queued_work_runs_in_submission_order_until_prioritised():
    w, ran = OrderedWorker(), []
    go = _held(w)
    futs = [w.submit(ran.append, k, order=-k) for k in range(5)]
    go.set()
    for f in futs:
        f.result()
    assert ran == [0, 1, 2, 3, 4]
    w.shutdown()


def test_prioritise_orders_what_is_queued_and_keeps_later_work_behind_it():
    w, ran = OrderedWorker(), []
    go = _held(w)
    for name, order in [("spec 8", 8), ("spec 6", 6), ("spec 5", 5), ("settle 6", 6),
                        ("barrier 3", 3), ("settle 5", 5), ("head", 28)]:
        w.submit(ran.append, name, order=order)
    w.prioritise()
    w.submit(ran.append, "next step", order=-1)  # after everything queued before
    go.set()
    w.shutdown()  # runs what is queued, then stops
    # by order; an item's own entries (spec 6 then settle 6) keep their submission order
    assert ran == ["barrier 3", "spec 5", "settle 5", "spec 6", "settle 6", "spec 8", "head",
                   "next step"]


def test_an_exception_reaches_the_waiter_and_the_worker_goes_on():
    w = OrderedWorker()

    def boom():
        raise ValueError("bad update")
    f = w.submit(boom)
    with pytest.raises(ValueError, match="bad update"):
        f.result()
    assert w.submit(lambda: 7).result() == 7
    w.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        w.submit(lambda: 1)
