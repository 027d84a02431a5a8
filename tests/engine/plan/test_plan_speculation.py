"""How many layers the planner lets speculate with exact clipping (plan.evaluate._speculative).

A speculative layer costs 12 B/param of host RAM and no CPU time, so the planner takes, of the
counts that keep host RAM 10% free, the fewest whose predicted speed is within SPEC_GAIN of the
best (at least SPEC_LAYERS). Checked here against the speed model itself, over every count.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from slideformer.engine.config import RunConfig, override
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.plan.evaluate import SPEC_GAIN, SPEC_LAYERS, TIGHT
from slideformer.engine.plan.memory import Precision, allocations, peak
from slideformer.engine.plan.speed import estimate
from slideformer.engine.runtime.shapes import speculative_layers
from tests.engine.plan.test_plan import model_folder

import torch

BASE = {"data.max_seq_len": 1024, "train.micro_batch": 8, "budget.vram": "24GiB"}


@pytest.fixture(scope="module")
def spec(tmp_path_factory):
    return load_spec(model_folder(tmp_path_factory.mktemp("spec"), "llama-3.2-3b"))


def plan(spec, **kw):
    return plan_run(override(RunConfig(), {**BASE, **kw}), spec, device="cuda", hardware=REFERENCE)


def speeds(spec, p) -> dict[int, float]:
    """The speed model's tokens/s of the plan's shape for every speculative count."""
    top = len(speculative_layers(spec.num_layers, p.exec_shape.device_layers, spec.num_layers))
    prec = Precision(torch.bfloat16, torch.float32)
    return {s: estimate(spec, replace(p.exec_shape, spec_layers=s), prec, "cuda", True,
                        p.hardware, 0, True).tokens_per_s for s in range(top + 1)}


def host_peak(spec, p, s: int) -> int:
    allocs = allocations(spec, replace(p.exec_shape, spec_layers=s),
                         Precision(torch.bfloat16, torch.float32), "cuda", True, 0, True)
    return peak(allocs, ("host",))


def test_with_room_it_speculates_as_many_as_pay(spec):
    p = plan(spec, **{"train.grad_accum": 4, "budget.ram": "120GiB"})
    S, by_count = p.exec_shape.spec_layers, speeds(spec, p)
    assert S > SPEC_LAYERS
    assert p.speed.tokens_per_s == pytest.approx(by_count[S])
    roomy = [s for s in by_count if host_peak(spec, p, s) <= TIGHT * p.tier("host").budget]
    best = max(by_count[s] for s in roomy)
    assert by_count[S] >= SPEC_GAIN * best  # within 1% of the best that fits
    assert by_count[S] > by_count[SPEC_LAYERS]
    assert p.tier("host").peak <= TIGHT * p.tier("host").budget
    assert host_peak(spec, p, S) - host_peak(spec, p, S - 1) == 12 * spec.params_per_layer


def test_host_ram_bounds_the_count(spec):
    roomy = plan(spec, **{"train.grad_accum": 4, "budget.ram": "120GiB"})
    short = plan(spec, **{"train.grad_accum": 4, "budget.ram": "72GiB"})
    assert SPEC_LAYERS <= short.exec_shape.spec_layers < roomy.exec_shape.spec_layers
    assert short.tier("host").peak <= TIGHT * short.tier("host").budget


def test_none_beyond_the_minimum_where_they_buy_nothing(spec):
    """A step bound by the GPU (64K tokens) gains nothing from more speculation."""
    p = plan(spec, **{"train.grad_accum": 8, "budget.ram": "120GiB"})
    by_count = speeds(spec, p)
    if max(by_count.values()) >= by_count[SPEC_LAYERS] / SPEC_GAIN:
        pytest.skip("the reference profile's 64K step still gains from speculation")
    assert p.exec_shape.spec_layers == SPEC_LAYERS


def test_ranks_of_a_data_parallel_run_plan_none(spec):
    cfg = override(RunConfig(), {**BASE, "train.grad_accum": 4, "budget.ram": "120GiB"})
    assert plan_run(cfg, spec, device="cuda", hardware=REFERENCE, speculate=False).exec_shape.spec_layers == 0


def test_the_plan_says_what_they_buy(spec):
    p = plan(spec, **{"train.grad_accum": 4, "budget.ram": "120GiB"})
    S, by_count = p.exec_shape.spec_layers, speeds(spec, p)
    note = next(n for n in p.notes if "update during the backward" in n)
    assert note.startswith(f"{S} decoder layers")
    extra = (host_peak(spec, p, S) - host_peak(spec, p, SPEC_LAYERS)) / (1 << 30)
    assert f"{extra:.1f} GiB more host RAM than {SPEC_LAYERS}" in note
    assert f"({by_count[S]:,.0f} against {by_count[SPEC_LAYERS]:,.0f})" in note
    fast = plan(spec, **{"train.grad_accum": 8, "budget.ram": "120GiB"})
    if fast.exec_shape.spec_layers == SPEC_LAYERS:
        assert not any("update during the backward" in n for n in fast.notes)


def test_the_plan_says_what_a_clipped_step_runs_at(spec):
    """A step whose norm exceeds the limit updates its speculative layers after the barrier
    (redoing what it speculated before the partial norm crossed the limit), so it runs as the
    same shape without speculation: measured on the H100, 3B at 8K tokens
    with 6 speculative layers, 0.79x of the steps of a run without clipping (benchmarks/
    RESULTS.md, 2026-12-07 ninth session); the plan says so beside its speed, which is for
    steps that do not clip. A frozen base (LoRA) updates no layer on the host: no such speed."""
    p = plan(spec, **{"train.grad_accum": 1, "budget.ram": "120GiB"})
    S, by_count = p.exec_shape.spec_layers, speeds(spec, p)
    assert S and by_count[0] < 0.98 * by_count[S]
    note = next(n for n in p.notes if "exceeds optim.max_grad_norm" in n)
    assert f"updates its {S} speculative layers after the clipping barrier" in note
    lora = plan(spec, **{"train.grad_accum": 1, "budget.ram": "120GiB", "train.method": "lora"})
    assert lora.clipped_tokens_per_s is None
    assert not any("exceeds optim.max_grad_norm" in n for n in lora.notes)
    assert f"about {by_count[0]:,.0f} tokens/s ({by_count[0] / by_count[S]:.0%}" in note
    unclipped = plan(spec, **{"train.grad_accum": 1, "budget.ram": "120GiB",
                              "optim.max_grad_norm": 0.0})
    assert not any("exceeds optim.max_grad_norm" in n for n in unclipped.notes)
    assert p.clipped_tokens_per_s == pytest.approx(by_count[0])
    assert unclipped.clipped_tokens_per_s is None
    assert p.to_dict()["clipped_tokens_per_s"] == p.clipped_tokens_per_s
