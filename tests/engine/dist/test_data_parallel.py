"""``train.gpus = 2`` on the CPU (gloo): two ranks over one shared host state train exactly what
one process trains on the same global batch, step for step, and resume each other's checkpoints."""
from __future__ import annotations

import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.dist.group import ItemPart, RankGroup
from slideformer.engine.events import Log, StepMetrics, read_events
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.runtime.host_state import AdamHyper, AdamWorkspace, HostItem, adam_update
from slideformer.engine.models.spec import load_spec
from slideformer.engine.models.weights import item_layout
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task
from slideformer.engine.train.trainer import Trainer

STEPS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("dp")
    make_tiny_model(root / "model", "llama", TinyShape(layers=3), seed=4)
    write_task(root / "train.jsonl", 80, 1)
    return root


def run_cfg(root, run: str, gpus: int, clip: float, steps: int = STEPS):
    return config_mod.from_dict({
        "model": {"path": str(root / "model")},
        "data": {"train": str(root / "train.jsonl"), "max_seq_len": 64},
        "optim": {"lr": 2e-3, "warmup_steps": 2, "weight_decay": 0.01, "max_grad_norm": clip},
        "train": {"micro_batch": 2, "grad_accum": 4, "max_steps": steps, "device": "cpu",
                  "gpus": gpus, "save_every": 2},
        "budget": {"slots": 2},
        "output": {"run_dir": str(root / run)}})


def losses(run_dir) -> list[float]:
    last = {}
    for ev in read_events(run_dir / "events.jsonl"):
        if isinstance(ev, StepMetrics):
            last[ev.step] = ev.loss
    return [last[k] for k in sorted(last)]


def weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "final" / "model.safetensors"))


def assert_same_run(a, b) -> None:
    torch.testing.assert_close(torch.tensor(losses(b)), torch.tensor(losses(a)), rtol=1e-5, atol=0)
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("clip", [0.5, 0.0])
def test_two_ranks_equal_one(root, clip):
    """Losses and final weights of 2 gloo ranks = 1 process, clipping on (every step clips
    here) and off (updates overlap the backward)."""
    one, two = root / f"one-{clip}", root / f"two-{clip}"
    assert run_training(run_cfg(root, one.name, 1, clip)) == "finished"
    assert run_training(run_cfg(root, two.name, 2, clip)) == "finished"
    assert len(losses(two)) == STEPS and losses(two)[-1] < losses(two)[0]
    assert any(isinstance(e, Log) and "2 ranks" in e.message
               for e in read_events(two / "events.jsonl"))
    assert_same_run(one, two)


def stop_at(cfg, step: int) -> None:
    t = Trainer(cfg, callbacks=[lambda ev: isinstance(ev, StepMetrics) and ev.step == step
                                and t.stop(True)])
    t.setup()
    assert t.train() == "stopped"
    t.cleanup()


@pytest.mark.parametrize("first,then", [(1, 2), (2, 1)])
def test_resume_on_another_gpu_count(root, first, then):
    """A checkpoint of a 1-rank run resumes on 2 ranks and back: the same run as uninterrupted."""
    whole = root / "one-0.5"
    if not (whole / "final").is_dir():
        run_training(run_cfg(root, whole.name, 1, 0.5))
    name = f"resume-{first}-{then}"
    stop_at(run_cfg(root, name, first, 0.5), 2)
    assert run_training(run_cfg(root, name, then, 0.5), resume=True) == "finished"
    assert_same_run(whole, root / name)


def test_rank_parts_cover_each_item_once(root):
    """The ranks' slices of an item tile it, and AdamW on the slices equals AdamW on the whole
    item (weight decay off for the norm inside a slice)."""
    spec = load_spec(root / "model")
    layout = item_layout(spec, "layer0")
    alloc = lambda n, dt: torch.zeros(n, dtype=dt)  # noqa: E731
    whole, split = (HostItem("layer0", layout, torch.float32, torch.float32, alloc, alloc)
                    for _ in range(2))
    g = torch.Generator().manual_seed(0)
    start = torch.randn(layout.numel, generator=g)
    for item in (whole, split):
        item.set_master(start)
        item.g.copy_(torch.randn(layout.numel, generator=torch.Generator().manual_seed(1)))
    hp = AdamHyper(lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, step=1,
                   grad_scale=0.5)
    adam_update(whole, hp, AdamWorkspace(), native=False)
    for rank in range(3):
        part = RankGroup(rank, 3).owned(split)
        assert isinstance(part, ItemPart)
        adam_update(part, hp, AdamWorkspace(), native=False)
    assert torch.equal(split.master(), whole.master())
    assert torch.equal(split.m, whole.m) and torch.equal(split.v, whole.v)
