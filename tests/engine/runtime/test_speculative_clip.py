"""Exact clipping with speculative updates equals the barrier mode bit for bit (CPU, fp32).

The speculative layers update with coefficient 1 during the backward and are repaired at the
barrier when the global norm exceeds the limit (slideformer.engine.runtime.grad_ring). Every case runs the
barrier mode (no speculative layers) and the speculative one on the same batches and compares
losses, norms, master weights and both moments with ``torch.equal``; the clipping thresholds make
clipping trigger at every step, at none, and at some; the barrier mode itself is held to dense
PyTorch AdamW + clip_grad_norm_ by tests/engine/runtime/test_sliding_equivalence.py, and here once more.
"""
from __future__ import annotations

import statistics
import threading

import pytest
import torch

import slideformer.engine.runtime.ends as ends_mod
from slideformer.engine.config import OptimConfig
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.shapes import regen_layers, speculative_layers
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.updates import OrderedWorker
from slideformer.engine.train.schedule import lr_at
from slideformer.engine.train.state import build_host_state, load_weights
from tests.engine.runtime.test_sliding_equivalence import STEPS, DenseReference, assert_same, make_batches

LAYERS = 4


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = make_tiny_model(tmp_path_factory.mktemp("spec") / "m", "qwen3", TinyShape(layers=LAYERS), seed=11)
    return load_spec(d), d


def run(spec, d, steps, clip, shape, threaded=False):
    """(step outputs, host state, optimizer config) of sliding training with ``shape``, the
    host state built as the trainer builds it (no gradient buffers for the speculative and the
    regenerated layers)."""
    optim = OptimConfig(lr=3e-3, weight_decay=0.05, schedule="cosine", warmup_steps=1, max_grad_norm=clip)
    backend = CpuBackend()
    regen = regen_layers(spec.num_layers, shape.device_layers, shape.regen_layers)
    spec_layers = speculative_layers(spec.num_layers, shape.device_layers, shape.spec_layers, regen)
    host = build_host_state(spec, backend, torch.float32, torch.float32, layer_grads=True,
                            borrowed=spec_layers + regen)
    load_weights(host, spec, d)
    ex = SlidingExecutor(spec, backend, host, shape, torch.float32)
    if threaded == "held":  # every update queues until the barrier reorders them
        ex.updater = HeldWorker()
    elif threaded:  # updates race the backward in a worker thread, as on CUDA
        ex.updater = OrderedWorker()  # the worker CUDA runs
    outs = []
    for k, mbs in enumerate(steps, start=1):
        hyper = lambda coef, k=k: AdamHyper(lr_at(k, STEPS, optim), optim.beta1, optim.beta2,  # noqa: E731
                                            optim.eps, optim.weight_decay, k, coef)
        if threaded == "held":
            ex.updater.hold()
        outs.append(ex.train_step(mbs, hyper, clip))
    ex.close()
    assert len(ex.snapshots.snaps) == len(spec_layers)
    if threaded == "held":
        assert ex.updater.reordered, "the barrier found no queued speculative update to move"
    return outs, host, optim



def assert_matches_dense(spec, d, result, steps) -> None:
    """A run's (outputs, masters, optimizer settings) held to dense PyTorch AdamW with
    clip_grad_norm_ on the same batches."""
    ref = DenseReference(spec, d, result[2])
    ref_losses = [ref.step(mbs, k, STEPS) for k, mbs in enumerate(steps, start=1)]
    assert_same(spec, ref, ref_losses, [o.loss for o in result[0]], result[1])

def assert_bitwise(a, b):
    (outs_a, host_a, _), (outs_b, host_b, _) = a, b
    assert [o.loss for o in outs_a] == [o.loss for o in outs_b]
    assert [repr(o.grad_norm) for o in outs_a] == [repr(o.grad_norm) for o in outs_b]  # nan too
    assert [o.skipped for o in outs_a] == [o.skipped for o in outs_b]
    for name, item in host_a.items():
        other = host_b[name]
        for field in ("w", "m", "v"):
            assert torch.equal(getattr(item, field), getattr(other, field)), f"{name}.{field}"


def _threshold(spec, d, steps, kind):
    """A max_grad_norm that clips every step, none, or some (from an unclipped run's norms)."""
    if kind == "always":
        return 1e-3
    if kind == "never":
        return 1e6
    outs, _, _ = run(spec, d, steps, 0.0,
                     ExecShape(micro_batch=1, seq_len=16, n_micro=len(steps[0]), slots=2))
    return statistics.median(o.grad_norm for o in outs)


SLOW = pytest.mark.slow


class HeldWorker(OrderedWorker):
    """The update worker held busy from the step's start until the barrier has queued its
    updates and reordered the queue: every speculative update of the step is still queued
    then (as when the CPU falls behind the backward), so the reordering is exercised."""

    def __init__(self):
        super().__init__()
        self.reordered = 0

    def hold(self) -> None:
        go, started = threading.Event(), threading.Event()
        self.submit(lambda: (started.set(), go.wait()))
        started.wait()
        self.go = go

    def prioritise(self) -> None:
        queued = [e[4] for e in self._queue]
        super().prioritise()
        self.reordered += queued != sorted(queued)
        self.go.set()


@pytest.mark.parametrize("kind,slots,n_micro,depth,threaded", [
    ("always", 2, 2, 2, False), pytest.param("always", 4, 1, 4, True, marks=SLOW),
    pytest.param("never", 2, 2, 4, True, marks=SLOW), ("never", 1, 3, 1, False),
    ("sometimes", 2, 2, 3, True), pytest.param("sometimes", 3, 1, 4, False, marks=SLOW),
    ("sometimes", 2, 1, 4, "held"), ("always", 2, 2, 3, "held")])
def test_speculative_equals_barrier(model, kind, slots, n_micro, depth, threaded):
    spec, d = model
    steps = make_batches(spec, n_micro, B=1, T=16, seed=12)
    clip = _threshold(spec, d, steps, kind)
    base = ExecShape(micro_batch=1, seq_len=16, n_micro=n_micro, slots=slots)
    barrier = run(spec, d, steps, clip, base)
    specul = run(spec, d, steps, clip, ExecShape(**{**base.__dict__, "spec_layers": depth}), threaded)
    clipped = [o.grad_norm > clip for o in barrier[0]]
    assert {"always": all(clipped), "never": not any(clipped),
            "sometimes": any(clipped) and not all(clipped)}[kind], clipped
    assert_bitwise(barrier, specul)
    if kind == "sometimes":  # and both are dense AdamW with clip_grad_norm_
        assert_matches_dense(spec, d, specul, steps)


@SLOW
def test_speculative_with_device_layers_equals_barrier(model):
    """Device-updated layers and the embedding/head stay on the barrier beside speculation."""
    spec, d = model
    steps = make_batches(spec, 2, B=1, T=16, seed=13)
    base = ExecShape(micro_batch=1, seq_len=16, n_micro=2, slots=2, device_update=True, device_layers=1)
    assert_bitwise(run(spec, d, steps, 1e-3, base),
                   run(spec, d, steps, 1e-3, ExecShape(**{**base.__dict__, "spec_layers": 4}), True))


@pytest.mark.parametrize("extra", [{"spec_layers": 3}, {"regen_layers": 2},
                                   {"spec_layers": 2, "regen_layers": 2}])
def test_skipped_step_undoes_speculative_updates(model, monkeypatch, extra):
    """A step whose gradients are non-finite is skipped whole: the speculative updates it ran
    (with NaN gradients) are undone, as the barrier mode never applies them, and the
    regenerated layers (slideformer.engine.runtime.regen) skip their second pass."""
    spec, d = model
    steps = make_batches(spec, 1, B=1, T=16, seed=14)
    real, calls = ends_mod.linear_ce_fwd_bwd, []

    def poisoned(*args, **kw):
        loss, gh = real(*args, **kw)
        calls.append(1)
        return loss, gh * float("nan") if len(calls) == 3 else gh
    monkeypatch.setattr(ends_mod, "linear_ce_fwd_bwd", poisoned)
    shape = ExecShape(micro_batch=1, seq_len=16, n_micro=1, slots=2)
    barrier = run(spec, d, steps, 0.5, shape)
    calls.clear()
    specul = run(spec, d, steps, 0.5, ExecShape(**{**shape.__dict__, **extra}), True)
    assert [o.skipped for o in specul[0]] == [False, False, True, False, False]
    assert_bitwise(barrier, specul)
    assert all(torch.isfinite(item.w).all() for item in specul[1].values())


def test_speculation_trades_buffers_instead_of_copying(monkeypatch):
    """A speculative update writes the new state into the snapshot's buffers and the layer takes
    them (no copy of the state); restoring hands the untouched pre-update buffers back."""
    from slideformer.engine.models.spec import Layout
    from slideformer.engine.runtime.grad_ring import Speculation
    from slideformer.engine.runtime.host_state import AdamWorkspace, HostItem, adam_update
    zeros = lambda k, d: torch.zeros(k, dtype=d)  # noqa: E731
    item = HostItem("layer0", Layout.build([("w", (33, 7))]), torch.bfloat16, torch.float32,
                    zeros, zeros, grad=False)
    item.set_master(torch.randn(item.numel) * 0.02)
    spec = Speculation({"layer0": item}, [0], zeros, zeros)
    spec.grad(0, item.numel).copy_(torch.randn(item.numel))
    fields = ("w", "rem", "m", "v")
    old = {k: getattr(item, k) for k in fields}
    before = {k: t.clone() for k, t in old.items()}
    copies = []
    real_copy = torch.Tensor.copy_
    monkeypatch.setattr(torch.Tensor, "copy_", lambda t, *a, **kw: copies.append(1) or real_copy(t, *a, **kw))
    hp = AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, 1.0)
    spec.update(0, item, lambda out: adam_update(item, hp, AdamWorkspace(), grad=spec.grad(0, item.numel), out=out))
    monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
    if cpu_adam_native():
        assert not copies  # the compiled kernel writes the other buffers directly
    assert all(getattr(item, k) is not old[k] for k in fields)
    assert all(torch.equal(old[k], before[k]) for k in fields)  # the pre-update state, kept
    assert not torch.equal(item.w, before["w"])
    assert spec.take(0)
    spec.restore(0, item)
    assert all(getattr(item, k) is old[k] for k in fields)


def cpu_adam_native() -> bool:
    from slideformer.engine.kernels import cpu_adam
    return cpu_adam.native_available()


def test_redo_of_every_speculated_layer_equals_barrier(model, monkeypatch):
    """The repair on its own: the early stop turned off, every speculative layer updates with
    coefficient 1 in every step, and each step clips, so every one is restored and redone at
    the barrier; the result is still the barrier mode's, bit for bit."""
    from slideformer.engine.runtime.updates import HostUpdates
    spec, d = model
    steps = make_batches(spec, 2, B=1, T=16, seed=12)
    made = []
    monkeypatch.setattr(HostUpdates, "_may_speculate", lambda self, layer: made.append(layer) or True)
    spec_run = run(spec, d, steps, 1e-3, ExecShape(micro_batch=1, seq_len=16, n_micro=2, slots=2,
                                                    spec_layers=3))
    assert made  # the speculative updates were made, and so had to be redone
    monkeypatch.undo()
    barrier = run(spec, d, steps, 1e-3, ExecShape(micro_batch=1, seq_len=16, n_micro=2, slots=2))
    assert_bitwise(spec_run, barrier)


def test_the_heads_norm_stops_speculation_before_the_first_layer(model, monkeypatch):
    """The partial norm starts from the head's: with a limit above the top layer's own norm
    but below it plus the head's, the step will clip, and no speculative update is made (it
    would be redone); above every norm, all are made."""
    from slideformer.engine.runtime import grad_ring
    from slideformer.engine.runtime.updates import HostUpdates
    spec, d = model
    steps = make_batches(spec, 2, B=1, T=16, seed=12)[:1]
    made, seen = [], {}
    real_update, real_may = grad_ring.Speculation.update, HostUpdates._may_speculate
    monkeypatch.setattr(grad_ring.Speculation, "update",
                        lambda self, layer, *a, **k: made.append(layer) or real_update(self, layer, *a, **k))

    def spy(self, layer):
        seen.setdefault(layer, (float(self.norms[layer]), float(self.norms[self.num_layers])))
        return real_may(self, layer)
    monkeypatch.setattr(HostUpdates, "_may_speculate", spy)
    shape = ExecShape(micro_batch=1, seq_len=16, n_micro=2, slots=2, spec_layers=3)
    run(spec, d, steps, 1e6, shape)
    assert len(made) == 3
    top, head = seen[spec.num_layers - 1]
    # the head's squared norm reached the host before the first layer's check, and is large
    # enough that the limit below sits clearly between the two sums
    assert head > 1e-3 * top
    made.clear()
    run(spec, d, steps, (top + head / 2) ** 0.5, shape)  # the top layer alone is below it
    assert made == []
