"""Exact clipping with regenerated gradients equals the barrier mode bit for bit (CPU, fp32).

The lowest ``regen_layers`` decoder layers own no host gradient buffer: the backward computes
their gradient for the global norm only and a second pass recomputes it once the clip
coefficient is known (slideformer.engine.runtime.regen). Every case runs the barrier mode and
the regenerating one on the same batches and compares losses, norms, master weights and both
moments with ``torch.equal``; thresholds clip every step, none, and some; one case is held to
dense PyTorch AdamW + clip_grad_norm_ as well.
"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.runtime.executor import ExecShape
from slideformer.engine.runtime.shapes import regen_layers, speculative_layers
from tests.engine.runtime.test_sliding_equivalence import make_batches
from tests.engine.runtime.test_speculative_clip import (  # noqa: F401 (model: a fixture)
    LAYERS, _threshold, assert_bitwise, assert_matches_dense,
    model, run)

SLOW = pytest.mark.slow


def _compare(spec, d, kind, n_micro, seed, regen, **shape):
    """(barrier run, regenerating run, threshold) on the same batches; checks the threshold
    clips as ``kind`` says and that the regenerated layers own no host gradient."""
    steps = make_batches(spec, n_micro, B=1, T=16, seed=seed)
    clip = _threshold(spec, d, steps, kind)
    base = ExecShape(micro_batch=1, seq_len=16, n_micro=n_micro, **shape)
    barrier = run(spec, d, steps, clip, base)
    regen_run = run(spec, d, steps, clip, ExecShape(**{**base.__dict__, "regen_layers": regen}),
                    threaded=shape.get("slots", 1) != 1)
    clipped = [o.grad_norm > clip for o in barrier[0]]
    assert {"always": all(clipped), "never": not any(clipped),
            "sometimes": any(clipped) and not all(clipped)}[kind], clipped
    gradless = regen_layers(LAYERS, base.device_layers, regen)
    assert gradless and all(regen_run[1][f"layer{i}"].g is None for i in gradless)
    speculative = speculative_layers(LAYERS, base.device_layers, base.spec_layers, gradless)
    assert not set(speculative) & set(gradless)
    assert all(regen_run[1][f"layer{i}"].g is not None for i in range(base.device_layers, LAYERS)
               if i not in gradless + speculative)
    return barrier, regen_run, steps


@pytest.mark.parametrize("kind,slots,n_micro,regen,ckpt", [
    ("always", 2, 2, 1, "gpu"), pytest.param("always", 1, 1, LAYERS, "host", marks=SLOW),
    ("never", 3, 3, LAYERS // 2, "host"), pytest.param("never", 2, 1, LAYERS, "gpu", marks=SLOW),
    pytest.param("sometimes", 3, 3, 1, "host", marks=SLOW), ("sometimes", 1, 2, LAYERS, "gpu"),
    pytest.param("sometimes", 2, 1, LAYERS // 2, "host", marks=SLOW)])
def test_regenerated_equals_barrier(model, kind, slots, n_micro, regen, ckpt):
    """Slots 1 run the updates inline, the others in a worker thread racing pass 2."""
    spec, d = model
    barrier, regen_run, _ = _compare(spec, d, kind, n_micro, 21, regen, slots=slots, checkpoints=ckpt)
    assert_bitwise(barrier, regen_run)


def test_regenerated_beside_speculation_matches_dense(model):
    """Speculative top layers and regenerated bottom ones in one run: the barrier's bits, and
    dense AdamW with clip_grad_norm_ on the steps that clip and those that do not."""
    spec, d = model
    barrier, regen_run, steps = _compare(spec, d, "sometimes", 2, 22, LAYERS // 2, slots=2,
                                         spec_layers=LAYERS)
    assert_bitwise(barrier, regen_run)
    assert_matches_dense(spec, d, regen_run, steps)


@SLOW
def test_regenerated_above_device_layers_equals_barrier(model):
    """With device-updated layers the regenerated ones start above them."""
    spec, d = model
    barrier, regen_run, _ = _compare(spec, d, "always", 2, 23, 2, slots=2, device_update=True,
                                     device_layers=1)
    assert_bitwise(barrier, regen_run)


def test_trainer_with_clip_regen_equals_without(tiny_run, tmp_path):
    """train.clip_regen through the trainer: the plan's shape carries it, the regenerated
    layers own no host gradient, and the run's losses and exported weights are those of the
    same run without it (CPU fp32, bit for bit)."""
    from slideformer.engine.train.trainer import Trainer
    from tests.engine.train.test_train import final_weights, step_losses
    runs = []
    for regen in (0, 2):
        cfg = tiny_run(tmp_path / f"regen{regen}", {"train.clip_regen": regen,
                                                    "optim.max_grad_norm": 0.05})
        t = Trainer(cfg)
        t.setup()
        assert t.executor.shape.regen_layers == regen
        assert t.executor.regen.layers == list(range(regen))
        assert all(t.host[f"layer{i}"].g is None and i not in t.executor.snapshots
                   for i in range(regen))
        assert t.train() == "finished"
        t.cleanup()
        runs.append((step_losses(tmp_path / f"regen{regen}"), final_weights(tmp_path / f"regen{regen}")))
    (losses_a, wa), (losses_b, wb) = runs
    assert losses_a == losses_b and wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
