"""The planner's NVMe-tier choice, its byte counts against the tier, and a Trainer run that uses it."""
from __future__ import annotations

import math
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from slideformer.engine.config import RunConfig, override
from slideformer.engine.events import StepMetrics, Timeline, read_events
from slideformer.engine.models.spec import load_spec, spec_from_config
from slideformer.engine.models.tiny import TinyShape, tiny_config
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.plan import memory as M
from slideformer.engine.plan.evaluate import DISK_MARGIN, Evaluator
from slideformer.engine.plan.planner import knobs_from_config
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape
from slideformer.engine.runtime.nvme import NvmeTier
from slideformer.engine.runtime.shapes import disk_layers
from slideformer.engine.runtime.shapes import BUFFERS, file_bytes
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.state import build_host_state
from slideformer.engine.train.trainer import Trainer


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: tiny matmuls
GiB = 1 << 30
CONFIGS = Path(__file__).parents[2] / "fixtures" / "configs"
EIGHT_B = {"budget.vram": "24GiB", "budget.ram": "96GiB", "data.max_seq_len": 2048,
           "train.micro_batch": 1, "train.grad_accum": 2}


@pytest.fixture
def llama_8b(tmp_path):
    d = tmp_path / "llama-3.1-8b"
    d.mkdir()
    shutil.copy(CONFIGS / "llama-3.1-8b.json", d / "config.json")
    return d


def test_planner_moves_the_fewest_layers_that_fit(llama_8b, tmp_path):
    """8 B params at 16 B/param need ~120 GiB: with 96 GiB and a disk, n layers' moments move."""
    cfg = override(RunConfig(), {**EIGHT_B, "model.path": str(llama_8b),
                                 "budget.nvme_dir": str(tmp_path), "budget.nvme_size": "2TB"})
    spec = load_spec(llama_8b)
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    n, per = plan.disk_layers, file_bytes(spec.params_per_layer, torch.bfloat16, torch.float32)
    assert 0 < n < spec.num_layers and plan.verdict != "does not fit"
    assert plan.tier("host").peak <= 96 * GiB and plan.tier("disk").peak == n * per
    staging = [a for a in plan.allocations if a.purpose == "NVMe staging buffers"]
    assert [a.bytes for a in staging] == [BUFFERS * per]
    busy = plan.speed.busy_dict()["disk"]  # a read and a write per disk layer and step
    assert busy == pytest.approx(n * per / 1.7e9 + n * per / 1.5e9)
    # one layer fewer does not leave the budget's margin free: n is the least
    assert plan.tier("host").peak <= 96 * GiB * (1 - DISK_MARGIN)
    ev = Evaluator(spec, "cuda", plan.budgets, REFERENCE)
    fewer = ev.choose(replace(knobs_from_config(cfg, spec, "cuda"), disk_layers=n - 1))
    assert fewer.tiers[1].peak > 96 * GiB * (1 - DISK_MARGIN)
    # with RAM to spare nothing goes to disk
    roomy = plan_run(override(cfg, {"budget.ram": "200GiB"}), spec, hardware=REFERENCE)
    assert roomy.disk_layers == 0 and roomy.tier("disk").peak == 0


def test_without_a_disk_the_fix_names_the_size(llama_8b, tmp_path):
    cfg = override(RunConfig(), {**EIGHT_B, "model.path": str(llama_8b)})
    spec = load_spec(llama_8b)
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    assert plan.verdict == "does not fit" and "host RAM" in plan.reason and plan.disk_layers == 0
    fix = next(f for f in plan.fixes if f.name == "optimizer state on disk")
    assert fix.available and fix.fits and fix.exact and fix.tier == "host"
    settings = dict(fix.settings)
    settings["budget.nvme_dir"] = str(tmp_path)  # the fix names a placeholder folder
    fixed = plan_run(override(cfg, settings), spec, hardware=REFERENCE)
    assert fixed.verdict != "does not fit" and fixed.disk_layers > 0
    assert plan.tier("host").peak - fixed.tier("host").peak == fix.saves
    assert settings["budget.nvme_size"] == f"{math.ceil(fixed.tier('disk').peak / GiB)}GiB"


def test_plan_counts_the_tier_byte_for_byte(tmp_path):
    """Host rows and the disk row against a real host state with 3 of 5 layers on disk."""
    spec = spec_from_config(tiny_config("llama", TinyShape(layers=5)))
    prec = M.Precision(torch.bfloat16, torch.float32)
    allocs = M.allocations(spec, ExecShape(1, 8, 1, 2), prec, "cpu", packed=False, disk_layers=3)
    with NvmeTier(tmp_path, [f"layer{i}" for i in disk_layers(5, 3)]) as tier:
        host = build_host_state(spec, CpuBackend(), torch.bfloat16, torch.float32, tier)
        for item in host.values():  # every disk item staged once: the pool fills
            if item.disk is not None:
                with item.disk.staged(write=False):
                    pass
        rows = {a.purpose: a.bytes for a in allocs}
        ram_moments = sum(t.numel() * t.element_size() for i in host.values()
                          for t in (i.m, i.v) if t is not None)
        assert rows["AdamW moments m, v"] == ram_moments
        assert rows["NVMe tier"] == tier.bytes
        assert rows["NVMe staging buffers"] == tier._allocated * tier._buf_bytes


RUN = {"optim.warmup_steps": 1, "train.max_steps": 4, "train.compute_dtype": "bfloat16",
       "budget.checkpoints": "gpu"}
"""This module's run settings over the tiny run's (tests/conftest.py)."""


@pytest.fixture(scope="module")
def run_base(tmp_path_factory):
    root = tmp_path_factory.mktemp("nvme-train")
    (root / "nvme").mkdir()
    return root


@pytest.fixture(scope="module")
def run_cfg(tiny_run, run_base):
    """``make(name, over=None) -> RunConfig``: a run of a six-layer model in ``run_base/name``."""
    shape = TinyShape(layers=6, hidden=32, heads=2, kv_heads=1, intermediate=48)
    return lambda name, over=None: tiny_run(run_base / name, {**RUN, **(over or {})}, shape=shape,
                                            rows=120)


def steps(run_dir: Path) -> tuple[list, int]:
    """(losses by step, disk spans seen in the timelines)."""
    last, disk = {}, 0
    for ev in read_events(run_dir / "events.jsonl"):
        if isinstance(ev, StepMetrics):
            last[ev.step] = ev.loss
        if isinstance(ev, Timeline):
            disk += sum(s.lane == "disk" for s in ev.spans)
    return [last[k] for k in sorted(last)], disk


def test_trainer_run_with_disk_layers_resumes_exactly(run_base, run_cfg):
    """RAM budget below the host state: the plan puts layers on disk, the run is stopped after
    step 2 and resumed; losses and the exported model equal an all-RAM uninterrupted run."""
    assert run_training(run_cfg("ram", {"budget.ram": "64GiB"})) == "finished"
    roomy = run_cfg("probe", {"budget.ram": "64GiB"})
    spec = load_spec(roomy.model.path)
    plan = plan_run(roomy, spec, device="cpu", hardware=REFERENCE)
    full = plan.tier("host").peak
    per_layer = 2 * 4 * spec.params_per_layer  # fp32 m and v
    # short host RAM drops the speculative layers' snapshots first (slideformer.engine.plan.evaluate)
    snaps = sum(a.bytes for a in plan.allocations if a.purpose == "speculative update snapshots")
    assert snaps > 0
    # regenerated gradients would make this budget fit without the disk (they come first): off.
    # The tier's search leaves DISK_MARGIN of the budget free: one layer short of that
    ram = int((full - snaps - per_layer) / (1 - DISK_MARGIN))
    cfg = run_cfg("disk", {"budget.ram": str(ram), "train.clip_regen": 0,
                           "budget.nvme_dir": str(run_base / "nvme")})
    t = Trainer(cfg, callbacks=[lambda ev: isinstance(ev, StepMetrics) and ev.step == 2 and t.stop(True)])
    t.setup()
    assert 0 < t.plan.disk_layers < spec.num_layers and t.tier is not None
    assert t.train() == "stopped"
    t.cleanup()
    assert run_training(cfg, resume=True) == "finished"
    (ref, _), (got, disk_spans) = steps(run_base / "ram"), steps(run_base / "disk")
    assert got == ref and disk_spans > 0
    from safetensors.torch import load_file
    a = load_file(str(run_base / "ram" / "final" / "model.safetensors"))
    b = load_file(str(run_base / "disk" / "final" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert list((run_base / "nvme").iterdir()) == []
