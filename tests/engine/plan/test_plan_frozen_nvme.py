"""The planner with a frozen base on the NVMe tier: host rows byte for byte against the built
state, the fewest layers that fit, the disk read time, and the fix "move the base to NVMe"."""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.cli import main
from slideformer.engine.config import LoraConfig, RunConfig, override
from slideformer.engine.models.lora import lora_spec
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.plan.evaluate import DISK_MARGIN, Evaluator
from slideformer.engine.plan.frozen import base_reads, frozen_allocations, layer_bytes
from slideformer.engine.plan.memory import Precision
from slideformer.engine.plan.planner import knobs_from_config
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import ExecShape
from slideformer.engine.runtime.nvme import NvmeTier
from slideformer.engine.runtime.shapes import BUFFERS, disk_layers, padded
from slideformer.engine.train.state import build_frozen_state, load_weights
from test_plan import model_folder

GiB = 1 << 30
PRESET = "slideformer/gui/resources/presets/qlora-70b-24gb.toml"


@pytest.mark.parametrize("method,dtype,n_disk", [("lora", torch.float32, 3),
                                                 ("qlora", torch.bfloat16, 4), ("qlora", torch.float32, 2)])
def test_host_and_disk_rows_are_the_built_state(tmp_path, method, dtype, n_disk):
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=5))
    spec = load_spec(d)
    lora = lora_spec(LoraConfig(rank=4))
    prec = Precision(dtype, torch.float32)
    allocs = frozen_allocations(spec, ExecShape(1, 8, 1, 2), prec, "cpu", False, method, lora,
                                n_disk)
    rows = {(a.tier, a.purpose): a.bytes for a in allocs}
    (tmp_path / "nvme").mkdir()
    with NvmeTier(tmp_path / "nvme", [f"layer{i}" for i in disk_layers(5, n_disk)]) as tier:
        host = build_frozen_state(spec, CpuBackend(), dtype, torch.float32, lora,
                                  nf4=method == "qlora", tier=tier)
        load_weights(host, spec, d)  # the loading's writes allocate the staging buffers
        base = sum(it.w.numel() * it.w.element_size() for n, it in host.items()
                   if not n.startswith("lora") and it.w is not None)
        assert rows["host", "frozen base weights"] == base
        assert rows["host", "base staging buffers"] == tier._allocated * tier._buf_bytes
        assert tier._allocated == min(n_disk, BUFFERS)
        assert rows["disk", "frozen base on NVMe"] == tier.bytes == n_disk * padded(layer_bytes(spec, prec, method))


def seventy_b(tmp_path, **over):
    """The QLoRA 70B preset on a Llama-3.1-70B shape with a 64 GiB host."""
    cfg = override(config_mod.load(PRESET), {"model.path": str(model_folder(tmp_path, "llama-3.1-70b")),
                                             "budget.ram": "64GiB", **over})
    return cfg, load_spec(cfg.model.path)


def test_70b_qlora_on_64_gib_moves_the_base_to_nvme(tmp_path):
    cfg, spec = seventy_b(tmp_path)
    plan = plan_run(cfg, spec, hardware=REFERENCE)
    assert plan.verdict == "does not fit" and "host RAM" in plan.reason and plan.disk_layers == 0
    fix = next(f for f in plan.fixes if f.name == "move the base to NVMe")
    assert fix.fits and fix.exact and fix.tier == "host" and fix is plan.fixes[0]
    settings = dict(fix.settings)
    (tmp_path / "nvme").mkdir()
    settings["budget.nvme_dir"] = str(tmp_path / "nvme")  # the fix names a placeholder folder
    fixed = plan_run(override(cfg, settings), spec, hardware=REFERENCE)
    n, L = fixed.disk_layers, spec.num_layers
    assert fixed.verdict != "does not fit" and 0 < n < L
    assert plan.tier("host").peak - fixed.tier("host").peak == fix.saves
    per = padded(layer_bytes(spec, Precision(torch.bfloat16, torch.float32), "qlora"))
    assert fixed.tier("disk").peak == n * per
    assert settings["budget.nvme_size"] == f"{math.ceil(n * per / GiB)}GiB"
    # the fewest layers that leave DISK_MARGIN of the budget free: one fewer does not
    ev = Evaluator(spec, "cuda", fixed.budgets, REFERENCE)
    knobs = knobs_from_config(override(cfg, settings), spec, "cuda")
    assert fixed.tier("host").peak <= 64 * GiB * (1 - DISK_MARGIN)
    assert ev.choose(replace(knobs, disk_layers=n - 1)).tiers[1].peak > 64 * GiB * (1 - DISK_MARGIN)
    # each disk layer is read in each window that loads it, at the profile's read rate
    k = fixed.exec_shape.slots
    reads = base_reads(L, k, disk_layers(L, n))
    assert 2 * n - 2 * (k + BUFFERS) <= reads <= 2 * n  # less the slots' and buffers' layers
    busy = fixed.speed.busy_dict()
    assert busy["disk"] == pytest.approx(reads * per / (REFERENCE.disk_read_gbs * 1e9))
    assert fixed.speed.step_time >= plan.speed.step_time


def test_disk_time_follows_the_reads(tmp_path):
    """With every layer on disk, a step reads each layer not kept in a slot twice (forward and
    backward; with K slots no staging buffer still holds a layer the next window needs first);
    a slow disk bounds the step."""
    cfg, spec = seventy_b(tmp_path)
    budgets = replace(plan_run(cfg, spec, hardware=REFERENCE).budgets, disk=1 << 50)
    knobs = replace(knobs_from_config(cfg, spec, "cuda"), disk_layers=spec.num_layers)
    ev = Evaluator(spec, "cuda", budgets, replace(REFERENCE, disk_read_gbs=0.2))
    e = ev.choose(knobs)
    L, k = spec.num_layers, e.shape.slots
    assert k > BUFFERS and base_reads(L, k, list(range(L))) == 2 * (L - k)
    speed = ev.speed(knobs, e)
    assert speed.bound == "disk" and speed.step_time >= speed.busy_dict()["disk"]


def test_cli_plan_shows_the_fix_and_the_disk_row(tmp_path, capsys):
    cfg, _ = seventy_b(tmp_path)
    path = tmp_path / "run.toml"
    path.write_text(config_mod.dumps(cfg))
    (tmp_path / "nvme").mkdir()
    assert main(["plan", "--config", str(path), "--gpu", "rtx4090"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "move the base to NVMe: frozen base weights of" in out
    assert main(["plan", "--config", str(path), "--gpu", "rtx4090",
                 "--disk", f"{tmp_path / 'nvme'}:100GiB"]) == 0
    out = capsys.readouterr().out
    assert "DOES NOT FIT" not in out
    row = next(line for line in out.splitlines() if line.startswith("disk  frozen base on NVMe"))
    assert "layers (0.41 GiB each)" in row and "host  base staging buffers" in out
