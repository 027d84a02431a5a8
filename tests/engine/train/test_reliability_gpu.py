"""Reliability on a CUDA GPU: a real out-of-memory error mid-step rolls the step back, and the
non-finite-gradient guard of the no-clipping mode holds with real copy streams."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.events import RunState, StepMetrics, read_events
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def gpu_cfg(tiny_run, tmp_path_factory):
    """``make(name, **over) -> RunConfig``: a tiny run (tests/conftest.py) on the GPU, large
    enough to fill the copy streams; ``over`` maps config keys (dots as double underscores)."""
    runs = tmp_path_factory.mktemp("reliability-gpu")
    shape = TinyShape(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=1024, vocab=512)

    def make(name: str, **over) -> config_mod.RunConfig:
        return tiny_run(runs / name, {
            "data.max_seq_len": 256, "optim.lr": 1e-3, "optim.weight_decay": 0.0,
            "train.micro_batch": 8, "train.grad_accum": 2, "train.max_steps": 5,
            "train.device": "cuda", **{k.replace("__", "."): v for k, v in over.items()}},
            shape=shape, rows=400)
    return make


def host_state(t: Trainer) -> dict:
    t.executor.drain()
    return {f"{n}.{k}": v.clone() for n, it in t.host.items()
            for k, v in it.state_tensors().items()}


def test_real_out_of_memory_rolls_the_step_back(gpu_cfg):
    """After step 2 the allocator may only keep what it holds: step 3 runs out of memory."""
    cfg = gpu_cfg("oom")
    seen = {}

    def on_event(ev):
        if isinstance(ev, StepMetrics) and ev.step == 2:
            seen["state"] = host_state(t)
            seen["data"] = t.stream.state_dict()
            torch.cuda.empty_cache()
            total = torch.cuda.get_device_properties(0).total_memory
            torch.cuda.set_per_process_memory_fraction(torch.cuda.memory_reserved() / total)

    t = Trainer(cfg, callbacks=[on_event])
    t.setup()
    try:
        assert t.train() == "failed"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        t.cleanup()
    run = Path(cfg.output.run_dir)
    end = [e for e in read_events(run / "events.jsonl") if isinstance(e, RunState)][-1]
    assert "out of GPU memory in step 3; the step was rolled back" in end.message, end.message
    assert "fix:" in end.message
    from safetensors.torch import load_file
    ckpt = run / "checkpoints" / "step-2"
    saved = {f"{f.stem}.{k}": v for f in ckpt.glob("*.safetensors")
             for k, v in load_file(str(f)).items()}
    assert saved.keys() == seen["state"].keys()
    assert all(torch.equal(saved[k], seen["state"][k].cpu()) for k in saved)  # untouched
    assert json.loads((ckpt / "trainer.json").read_text())["data"] == seen["data"]
    assert run_training(cfg, resume=True) == "finished"


def test_gradient_guard_without_clipping_on_cuda_streams(gpu_cfg, monkeypatch):
    """An overflow in layer 1's gradient: layers 3 and 2 (already updated) change, the rest not."""
    from slideformer.engine.runtime.executor import SlidingExecutor
    real, calls = SlidingExecutor._layer_backward, [0]

    def layer_backward(self, w, g, *a):
        out = real(self, w, g, *a)
        c, calls[0] = calls[0], calls[0] + 1
        if c // 2 == 2 * 4 + 2:  # step 3 (2 micro-batches a layer, 4 layers): layer 1
            g.fill_(float("inf"))
        return out

    monkeypatch.setattr(SlidingExecutor, "_layer_backward", layer_backward)
    states = []
    # every layer updated by the CPU (the planner would keep this tiny model's optimizer on the
    # GPU, where updates follow the barrier and a skip is always whole)
    t = Trainer(gpu_cfg("guard", optim__max_grad_norm=0.0, budget__gpu_layers=0),
                callbacks=[lambda ev: isinstance(ev, StepMetrics) and states.append(host_state(t))])
    t.setup()
    try:
        assert t.train() == "finished"
    finally:
        t.cleanup()
    before, after = states[1], states[2]
    changed = {k.split(".")[0] for k in before if not torch.equal(before[k], after[k])}
    assert changed == {"layer3", "layer2"}
