"""The planner knows train.method: LoRA / QLoRA memory per tier, verdicts, fixes, speed."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine.cli import main
from slideformer.engine.config import LoraConfig, RunConfig, override
from slideformer.engine.devices import moments_torch_dtype
from slideformer.engine.models.lora import adapter_layout, lora_spec
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.runtime.backend import CpuBackend
from slideformer.engine.runtime.executor import SlidingExecutor
from slideformer.engine.train.state import build_frozen_state
from test_plan import CONSUMER, model_folder

GiB = 1 << 30
BIG = {"budget.vram": "24GiB", "budget.ram": "128GiB", "train.device": "cuda"}


def plan(tmp_path, name, method, **extra):
    cfg = override(RunConfig(), {**BIG, "train.method": method, **extra})
    return plan_run(cfg, load_spec(model_folder(tmp_path, name)), hardware=REFERENCE)


@pytest.mark.parametrize("name", ["llama-3.1-70b", "mistral-large-instruct-2407"])
def test_qlora_fits_70b_and_123b_on_24_gib_and_128_gib(tmp_path, name):
    p = plan(tmp_path, name, "qlora")
    assert p.verdict in ("fits", "tight"), p.reason
    assert p.tier("gpu").peak <= 24 * GiB and p.tier("host").peak <= 128 * GiB
    assert p.max_micro_batch >= 1 and p.speed.tokens_per_s > 0
    base = next(a for a in p.allocations if a.purpose == "frozen base weights")
    spec = load_spec(tmp_path / name)
    rest = (spec.embed_layout.numel + spec.head_layout.numel) * 2
    per_param = (base.bytes - rest) / (spec.num_layers * spec.params_per_layer)
    assert 0.5 < per_param < 0.53  # 4-bit codes + 1/64 B absmax codes + second-level scales
    assert not any(a.purpose in ("gradient slots", "embedding grads", "AdamW moments m, v")
                   for a in p.allocations)


def test_cli_plan_says_fits_for_qlora_70b(tmp_path, capsys):
    d = model_folder(tmp_path, "llama-3.1-70b")
    assert main(["plan", "--model", str(d), "--method", "qlora", "--vram", "24GiB", "--ram",
                 "128GiB", "--gpu", "rtx4090"]) == 0
    out = capsys.readouterr().out
    assert "verdict: FITS" in out and "qlora" in out


def test_bf16_lora_70b_overflows_ram_and_the_fixes_are_nvme_or_qlora(tmp_path):
    """The exact fix within the method comes first (the base of some layers on the NVMe tier),
    then the change of method."""
    p = plan(tmp_path, "llama-3.1-70b", "lora")
    assert p.verdict == "does not fit" and "host RAM" in p.reason
    assert [f.name for f in p.fixes[:2]] == ["move the base to NVMe", "switch to qlora"]
    assert all(f.fits for f in p.fixes[:2])
    assert dict(p.fixes[1].settings) == {"train.method": "qlora"}


def test_full_8b_offers_the_frozen_methods(tmp_path):
    """Full fine-tuning of an 8B at 64 GiB of RAM does not fit; LoRA and QLoRA do."""
    p = plan(tmp_path, "llama-3.1-8b", "full", **{"budget.ram": "64GiB"})
    names = {f.name: f for f in p.fixes}
    assert p.verdict == "does not fit"
    assert names["switch to lora"].fits and names["switch to qlora"].fits
    assert not names["switch to lora"].exact


def test_frozen_step_is_cheaper_than_full(tmp_path):
    """Same shape: a frozen base moves no gradients, runs no CPU optimizer and does fewer FLOPs."""
    extra = {"budget.ram": "1TiB", "train.micro_batch": 4, "data.max_seq_len": 2048}
    full = plan(tmp_path, "llama-3.1-8b", "full", **extra)
    lora = plan_run(override(RunConfig(), {**BIG, **extra, "train.method": "lora"}),
                    load_spec(tmp_path / "llama-3.1-8b"), hardware=REFERENCE)
    busy_f, busy_l = full.speed.busy_dict(), lora.speed.busy_dict()
    assert busy_l["pcie d2h"] == 0 and busy_l["cpu optimizer"] == 0
    assert lora.speed.flops < full.speed.flops
    assert lora.speed.tokens_per_s > full.speed.tokens_per_s


@pytest.mark.parametrize("method,moments", [("lora", "float32"), ("qlora", "float32"),
                                            ("lora", "int8")])
def test_plan_mirrors_what_the_executor_allocates(tmp_path, method, moments):
    """The planned slot, base and adapter bytes are the executor's and host state's own (8-bit
    moments: whole blocks of codes and scales per adapter item)."""
    d = make_tiny_model(tmp_path / "m", "llama", TinyShape(layers=4))
    spec = load_spec(d)
    cfg = override(RunConfig(), {**CONSUMER, "model.path": str(d), "train.method": method,
                                 "train.device": "cpu", "budget.nvme_size": "0",
                                 "optim.moments_dtype": moments})
    p = plan_run(cfg, spec, hardware=REFERENCE)
    lora = lora_spec(LoraConfig())
    host = build_frozen_state(spec, CpuBackend(), torch.float32, moments_torch_dtype(moments),
                              lora, nf4=method == "qlora")
    ex = SlidingExecutor(spec, CpuBackend(), host, p.exec_shape, torch.float32, lora=lora)
    by = {a.purpose: a.bytes for a in p.allocations}
    slots = sum(s.buf.numel() * s.buf.element_size() for s in ex.pool.slots)
    assert by["parameter slots"] == slots
    base = sum(it.w.numel() * it.w.element_size() for n, it in host.items() if not n.startswith("lora"))
    assert by["frozen base weights"] == base
    A = spec.num_layers * adapter_layout(spec, lora, 0).numel
    dev = sum(t.numel() * t.element_size() for item in ex.dev.values()
              for t in (item.w, item.m, item.v, item.g))
    assert by["adapters and their optimizer state"] == dev
    assert (dev == A * 16) == (moments == "float32")
    adapters = [it for n, it in host.items() if n.startswith("lora")]
    assert by["adapters (checkpoint copy)"] == sum(t.numel() * t.element_size() for it in adapters
                                                   for t in (it.w, it.m, it.v))
    ex.close()


def test_qlora_70b_preset_fits_a_70b(tmp_path):
    """slideformer/gui/resources/presets/qlora-70b-24gb.toml on a Llama-3.1-70B with 128 GiB of RAM."""
    from slideformer.engine import config as config_mod
    from pathlib import Path
    preset = Path(__file__).parents[3] / "slideformer" / "gui" / "resources" / "presets" / "qlora-70b-24gb.toml"
    cfg = override(config_mod.load(preset), {"budget.ram": "128GiB"})
    p = plan_run(cfg, load_spec(model_folder(tmp_path, "llama-3.1-70b")), hardware=REFERENCE)
    assert p.method == "qlora" and p.verdict == "fits", p.reason
