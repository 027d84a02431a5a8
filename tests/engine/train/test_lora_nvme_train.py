"""A LoRA / QLoRA run whose host RAM is short of the base: the plan puts the base of some layers
on the NVMe tier, the run writes them once while loading, is stopped, resumed (the base is read
from the model folder again, the checkpoint holds only the adapters), and ends with the losses
and adapters of an uninterrupted run with the base in RAM."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slideformer.engine.events import Log, StepMetrics
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.plan import REFERENCE, plan_run
from slideformer.engine.plan.frozen import layer_bytes
from slideformer.engine.plan.memory import Precision
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.trainer import Trainer
from test_train import step_losses

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py: tiny matmuls
SHAPE = TinyShape(layers=8, hidden=32, heads=2, kv_heads=1, intermediate=48)
"""Eight layers: moving n > 3 of them frees more RAM than the tier's 3 staging buffers take."""


@pytest.fixture(scope="module")
def cfg(tiny_run, tmp_path_factory):
    """``make(name, method, over=None) -> RunConfig`` in this module's folder."""
    root = tmp_path_factory.mktemp("lora-nvme")

    def make(name, method, over=None):
        return tiny_run(root / name, {"train.method": method, "train.max_steps": 4,
                                      "train.grad_accum": 2, "optim.lr": 2e-2, "lora.rank": 4,
                                      **(over or {})}, shape=SHAPE, rows=120)
    return make


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_base_on_the_tier_resumes_like_an_all_ram_run(cfg, tmp_path, method):
    ram = cfg(f"{method}-ram", method)
    assert run_training(ram) == "finished"
    spec = load_spec(ram.model.path)
    full = plan_run(ram, spec, device="cpu", hardware=REFERENCE).tier("host").peak
    per = layer_bytes(spec, Precision(torch.float32, torch.float32), method)
    (tmp_path / "nvme").mkdir()
    disk = cfg(f"{method}-disk", method, {"budget.ram": str(full - 2 * per),
                                          "budget.nvme_dir": str(tmp_path / "nvme")})
    logs = []
    t = Trainer(disk, callbacks=[logs.append, lambda ev: isinstance(ev, StepMetrics)
                                 and ev.step == 2 and t.stop(True)])
    t.setup()
    n = t.plan.disk_layers
    assert 3 < n <= spec.num_layers and t.plan.verdict != "does not fit"
    assert any(isinstance(e, Log) and "frozen base weights of" in e.message for e in logs)
    on_disk = [name for name, item in t.host.items() if getattr(item, "disk", None) is not None]
    assert len(on_disk) == n and all(t.host[name].w is None for name in on_disk)
    written = t.tier.bytes_written
    assert written == t.tier.bytes == t.plan.tier("disk").peak
    assert t.train() == "stopped"
    assert t.tier.bytes_written == written and t.tier.bytes_read > 0  # read, never rewritten
    t.cleanup()
    ck = Path(disk.output.run_dir) / "checkpoints" / "step-2"
    assert ck.is_dir() and not any("layer" in p.name or "embed" in p.name for p in ck.iterdir())
    assert run_training(disk, resume=True) == "finished"
    assert step_losses(Path(ram.output.run_dir)) == step_losses(Path(disk.output.run_dir))
    a = load_file(f"{ram.output.run_dir}/final/adapter_model.safetensors")
    b = load_file(f"{disk.output.run_dir}/final/adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert list((tmp_path / "nvme").iterdir()) == []  # the tier's files go with the process
