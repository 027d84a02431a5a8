"""The planner with regenerated gradients (exact clipping, slideformer.engine.runtime.regen).

Memory rows against the buffers the executor really holds (CPU), the planner's choice of the
regenerated layers on the Llama-3.1-8B shape, and the config key's checks.
"""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.config import RunConfig, override
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.plan import memory as M
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape, SlidingExecutor
from slideformer.engine.runtime.host_state import AdamHyper
from slideformer.engine.runtime.regen import Regeneration
from slideformer.engine.runtime.shapes import regen_layers
from slideformer.engine.train.state import build_host_state
from slideformer.engine.validate import validate
from tests.engine.plan.test_plan import model_folder
from tests.engine.plan.test_plan_memory import _nbytes, _rows, _spec
from tests.engine.runtime.test_sliding_equivalence import make_batches

GiB = 1 << 30
# Llama-3.1-8B full fine-tuning with clipping and fp32 moments, 64 x 1024 tokens per step
# (micro-batch 8 x 8 accumulated) on the reference H200 capped at 24 GiB, 128 GiB of RAM
EIGHT_B = {"budget.vram": "24GiB", "budget.ram": "128GiB", "data.max_seq_len": 1024,
           "train.micro_batch": 8, "train.grad_accum": 8, "optim.max_grad_norm": 1.0,
           "optim.moments_dtype": "float32"}


@pytest.mark.parametrize("regen,ckpt", [(2, "gpu"), pytest.param(4, "host", marks=pytest.mark.slow)])
def test_regen_rows_match_the_executor(monkeypatch, regen, ckpt):
    """The host gradient rows and the boundary row are the bytes the executor holds."""
    spec = _spec("llama", layers=4, hidden=32, heads=4, kv_heads=2, intermediate=48, vocab=64)
    shape = ExecShape(micro_batch=2, seq_len=8, n_micro=2, slots=2, checkpoints=ckpt,
                      regen_layers=regen)
    backend = CpuBackend()
    gradless = regen_layers(4, 0, regen)
    host = build_host_state(spec, backend, torch.float32, torch.float32, borrowed=gradless)
    torch.manual_seed(0)
    for item in host.values():
        item.set_master(torch.randn(item.numel) * 0.05)
    ex = SlidingExecutor(spec, backend, host, shape, torch.float32)
    allocs = M.allocations(spec, shape, M.Precision(torch.float32, torch.float32), "cpu",
                           packed=False, clip=True)
    assert _rows(allocs, "gradient buffers") == _nbytes(*(i.g for i in host.values()), *ex.ring.bufs)
    assert len(ex.ring.bufs) == min(shape.grad_ring, regen)
    kept, real = [], Regeneration.keep

    def keep(self, layer, gys):
        real(self, layer, gys)
        if layer == self.top:
            kept.append(_nbytes(*self.boundary))
    monkeypatch.setattr(Regeneration, "keep", keep)
    mbs = make_batches(spec, 2, B=2, T=8, seed=3)[0]
    out = ex.train_step(mbs, lambda c: AdamHyper(1e-3, 0.9, 0.999, 1e-8, 0.0, 1, c), 1e-3)
    ex.close()
    assert not out.skipped and kept == [_rows(allocs, "regenerated-gradient boundary")]


@pytest.fixture(scope="module")
def eight_b(tmp_path_factory):
    """The plan of the 8B run with some settings changed."""
    folder = model_folder(tmp_path_factory.mktemp("cfg"), "llama-3.1-8b")
    spec = load_spec(folder)

    def plan(**extra):
        cfg = override(RunConfig(), {**EIGHT_B, "model.path": str(folder), **extra})
        return plan_run(cfg, spec, hardware=REFERENCE)
    plan.spec = spec
    return plan


def test_8b_with_clipping_fits_128_gib_with_regenerated_layers(eight_b):
    auto = eight_b()
    off = eight_b(**{"train.clip_regen": 0})
    # without: bf16 weights + remainders, fp32 moments and fp32 gradients = 16 B/param
    assert off.verdict == "does not fit" and off.tier("host").peak > 128 * GiB
    assert off.exec_shape.regen_layers == 0
    k = auto.exec_shape.regen_layers
    assert auto.verdict != "does not fit" and 0 < k < 32
    assert auto.tier("host").peak <= 128 * GiB and auto.tier("gpu").peak <= 24 * GiB
    fewer = eight_b(**{"train.clip_regen": k - 1})
    assert fewer.tier("host").peak > 128 * GiB  # the fewest that fit
    # 4 B per parameter of each regenerated layer, less the ring's buffers
    saved = off.tier("host").peak - auto.tier("host").peak
    assert saved == (k - min(4, k)) * eight_b.spec.params_per_layer * 4
    assert auto.speed.tokens_per_s < off.speed.tokens_per_s  # pass 2 costs compute
    assert auto.speed.flops > off.speed.flops


def test_a_plan_without_enough_regenerated_layers_offers_the_fewest_that_fit(eight_b):
    """train.clip_regen set too low: the fix names the planner's own count, its saving and speed
    are those of the run with it, and applying it fits; with the planner's choice (auto) or
    without clipping there is nothing to offer."""
    auto = eight_b()
    k = auto.exec_shape.regen_layers
    for given in (0, k - 1):
        off = eight_b(**{"train.clip_regen": given})
        fix = next(f for f in off.fixes if f.name == "regenerate gradients")
        assert dict(fix.settings) == {"train.clip_regen": k} and fix.fits and fix.exact
        assert f"train.clip_regen {given} -> {k}" in fix.change and "fewer tokens/s" in fix.change
        fixed = eight_b(**{"train.clip_regen": k})
        assert fixed.verdict != "does not fit" and fixed.exec_shape.regen_layers == k
        assert fix.tier == "host" and fix.saves == off.tier("host").peak - fixed.tier("host").peak
        assert fix.tokens_per_s == fixed.speed.tokens_per_s < off.speed.tokens_per_s
    assert not any(f.name == "regenerate gradients" for f in auto.fixes)
    no_clip = eight_b(**{"train.clip_regen": 0, "optim.max_grad_norm": 0.0, "budget.ram": "100GiB"})
    assert no_clip.verdict == "does not fit"
    assert not any(f.name == "regenerate gradients" for f in no_clip.fixes)


def test_regen_stays_off_when_ram_suffices(eight_b):
    assert eight_b(**{"budget.ram": "200GiB"}).exec_shape.regen_layers == 0
    assert eight_b(**{"optim.max_grad_norm": 0.0}).exec_shape.regen_layers == 0


@pytest.mark.parametrize("value,message", [("some", "is 'some'"), (-1, "train.clip_regen")])
def test_clip_regen_is_checked(value, message):
    with pytest.raises(UserError, match=message) as err:
        validate(override(RunConfig(), {"train.clip_regen": value}), "values")
    assert "train.clip_regen" in str(err.value)
