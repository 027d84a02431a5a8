"""Planning for the machine the user means: a GPU preset, or this machine (CPU only here).

Properties checked against the preset table itself: the VRAM budget is the preset's (not this
machine's GPU's), the verdict names the preset, and the predicted GPU compute time scales with
the preset's published bf16 rate.
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from slideformer.engine import cli
from slideformer.engine.config import RunConfig, override
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan import PRESETS, load_profile, plan_run
from slideformer.engine.plan.budget import vram_margin
from slideformer.engine.plan.machine import GpuMemory
from slideformer.engine.plan.targets import MATMUL_SHARE
from test_plan import model_folder

GiB = 1 << 30
SHAPE = {"data.max_seq_len": 1024, "train.micro_batch": 4, "train.grad_accum": 2,
         "budget.ram": "64GiB"}
SAME_SHAPE = {"budget.slots": 2, "budget.checkpoints": "host", "budget.gpu_layers": 0}
"""One executor shape on every card, so that only the card's speed differs."""


@pytest.fixture
def nothing_here(monkeypatch, tmp_path):
    """This machine has no NVIDIA GPU and no measured profile."""
    monkeypatch.setattr("slideformer.engine.plan.targets.gpu_memory", lambda: None)
    monkeypatch.setattr("slideformer.engine.plan.planner.gpu_memory", lambda: None)
    monkeypatch.setattr("slideformer.engine.plan.targets.cache_file", lambda: tmp_path / "none.json")


def plan_for(tmp_path, target, **over):
    folder = tmp_path / "llama-3.2-3b"
    spec = load_spec(folder if folder.is_dir() else model_folder(tmp_path, "llama-3.2-3b"))
    return plan_run(override(RunConfig(), {**SHAPE, **over}), spec, hardware=target)


@pytest.mark.parametrize("key", sorted(PRESETS))
def test_a_preset_plans_with_its_own_vram_name_and_speed(tmp_path, nothing_here, key):
    p = PRESETS[key]
    plan = plan_for(tmp_path, key)
    assert plan.device == "cuda"
    assert plan.budgets.vram == p.vram_bytes - vram_margin(p.vram_bytes)
    assert plan.reason.endswith(f"on {p.name}") and plan.hardware.name == p.name
    assert plan.hardware.matmul_tflops == pytest.approx(p.bf16_tflops * MATMUL_SHARE)
    ref = PRESETS["rtx4090"]
    mine, other = plan_for(tmp_path, key, **SAME_SHAPE), plan_for(tmp_path, ref.key, **SAME_SHAPE)
    # the same shape; how many layers speculate follows the GPU's speed against the CPU's
    assert replace(mine.exec_shape, spec_layers=0) == replace(other.exec_shape, spec_layers=0)
    compute = mine.speed.busy_dict()["gpu compute"]
    assert compute * p.bf16_tflops == pytest.approx(
        other.speed.busy_dict()["gpu compute"] * ref.bf16_tflops)


def test_a_preset_ignores_the_gpu_of_this_machine(tmp_path, nothing_here, monkeypatch):
    here = GpuMemory("NVIDIA GeForce RTX 3060", 12 * GiB, 11 * GiB, 0)
    monkeypatch.setattr("slideformer.engine.plan.planner.gpu_memory", lambda: here)
    monkeypatch.setattr("slideformer.engine.plan.targets.gpu_memory", lambda: here)
    assert plan_for(tmp_path, "rtx5090").budgets.vram == 32 * GiB - vram_margin(32 * GiB)
    mine = plan_for(tmp_path, "this")  # this machine: its own GPU, and its preset's speed
    assert mine.budgets.vram == 11 * GiB - vram_margin(12 * GiB)
    assert mine.hardware.matmul_tflops == pytest.approx(25.5 * MATMUL_SHARE)
    with pytest.raises(UserError, match="more than"):
        plan_for(tmp_path, "rtx3060", **{"budget.vram": "16GiB"})


def test_without_a_gpu_this_machine_means_the_cpu_backend(tmp_path, nothing_here):
    plan = plan_for(tmp_path, "this")
    assert plan.device == "cpu" and plan.budgets.vram is None
    assert "this machine (no NVIDIA GPU, not measured)" in plan.reason
    assert "H200" not in plan.reason and "reference" not in plan.hardware.name
    with pytest.raises(UserError, match="no GPU to plan for"):
        plan_for(tmp_path, "this", **{"train.device": "cuda", "budget.vram": "8GiB"})


def test_cli_plans_for_a_named_gpu(tmp_path, nothing_here, capsys):
    folder = model_folder(tmp_path, "llama-3.2-3b")
    assert cli.main(["plan", "--model", str(folder), "--gpu", "rtx3090", "--ram", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "hardware: NVIDIA GeForce RTX 3090 24 GB" in out
    assert "on NVIDIA GeForce RTX 3090 24 GB" in out.split("verdict:")[1].splitlines()[0]
    assert cli.main(["plan", "--model", str(folder), "--gpu", "gtx9000"]) == 2
    err = capsys.readouterr().err
    assert "'gtx9000' is not a GPU the planner knows" in err and "rtx4090" in err


def test_load_profile_names(nothing_here):
    assert load_profile("RTX-4090").preset == "rtx4090"
    assert load_profile("this").preset == ""


# ---- a container's memory limit ------------------------------------------------------------------
@pytest.mark.parametrize("files,limit", [
    ({"memory.max": "4294967296\n", "memory.current": "1073741824\n"}, 4 << 30),  # cgroup v2
    ({"memory.max": "max\n"}, None),  # v2 without a limit
    ({"memory/memory.limit_in_bytes": "2147483648\n",
      "memory/memory.usage_in_bytes": "0\n"}, 2 << 30),  # cgroup v1
    ({}, None)])  # no cgroup files at all
def test_host_memory_is_the_cgroup_limit_where_one_is_lower(tmp_path, monkeypatch, files, limit):
    """A process past its container's memory.max is killed whatever the machine's RAM: the
    planner's host total and available memory stay within the limit (less what it uses)."""
    import psutil

    from slideformer.engine.plan import machine
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(machine, "CGROUP", str(tmp_path))
    mem, vm = machine.host_memory(), psutil.virtual_memory()
    if limit is None or limit >= vm.total:
        assert mem.total == vm.total
    else:
        used = int(next(v for k, v in files.items() if "current" in k or "usage" in k))
        assert mem.total == limit and mem.available <= limit - used
