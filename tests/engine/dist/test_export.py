"""``slideformer export-distributed``: the FSDP2 script, run by torchrun as 2 CPU processes (gloo),
trains what a one-process dense PyTorch loop and ``slideformer train`` train, step for step."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from slideformer.engine import api
from slideformer.engine import config as config_mod
from slideformer.engine.cli import main
from slideformer.engine.dist.export import export_distributed
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task

transformers = pytest.importorskip("transformers")
STEPS = 4


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    make_tiny_model(root / "model", "llama", TinyShape(layers=2), seed=4)
    write_task(root / "train.jsonl", 80, 1)
    return root


def run_cfg(root, run: str, clip: float = 0.5, **train):
    return config_mod.from_dict({
        "model": {"path": str(root / "model")},
        "data": {"train": str(root / "train.jsonl"), "max_seq_len": 64},
        "optim": {"lr": 2e-3, "warmup_steps": 2, "weight_decay": 0.01, "max_grad_norm": clip},
        "train": {"micro_batch": 2, "grad_accum": 2, "max_steps": STEPS, "device": "cpu",
                  **train},
        "budget": {"slots": 2},
        "output": {"run_dir": str(root / run)}})


def torchrun(folder, nproc: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc-per-node={nproc}", str(folder / "train_fsdp.py")],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]


def step_losses(run_dir) -> list[float]:
    return [e.loss for e in api.read_events(run_dir / "events.jsonl")
            if isinstance(e, api.StepMetrics)]


def packed(doc: torch.Tensor) -> dict:
    """Positions restarting at each document and an additive mask keeping attention inside
    it (eager attention's convention), from per-token document ids (B, T)."""
    T = doc.shape[1]
    pos = torch.stack([torch.cat([torch.arange(int(n)) for n in torch.unique_consecutive(
        row, return_counts=True)[1]]) for row in doc])
    allowed = (doc[:, :, None] == doc[:, None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return {"position_ids": pos, "attention_mask": mask[:, None]}


def dense_reference(folder):
    """One process, no FSDP: the exported rows and order through Hugging Face's model with
    torch.optim.AdamW and clip_grad_norm_; returns the losses and the final weights."""
    s = json.loads((folder / "settings.json").read_text())
    data = {k: torch.from_numpy(np.load(folder / "data" / f"{k}.npy").astype(np.int64))
            for k in ("input_ids", "labels", "doc_ids")}
    order = np.load(folder / "data" / "order.npy")
    model = transformers.AutoModelForCausalLM.from_pretrained(s["model"], dtype=torch.float32,
                                                              attn_implementation="eager")
    params = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() > 1],
                              "weight_decay": s["weight_decay"]},
                             {"params": [p for p in params if p.dim() == 1], "weight_decay": 0.0}],
                            lr=s["lrs"][0], betas=(s["beta1"], s["beta2"]), eps=s["eps"])
    losses = []
    for step, micro in enumerate(order):
        tokens = sum(int((data["labels"][rows] != -100).sum()) for rows in micro)
        total = 0.0
        for rows in micro:
            ids, labels, doc = (data[k][rows] for k in ("input_ids", "labels", "doc_ids"))
            logits = model(input_ids=ids, **packed(doc)).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(),
                                                     ignore_index=-100, reduction="sum") / tokens
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, s["max_grad_norm"])
        for g in opt.param_groups:
            g["lr"] = s["lrs"][step]
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {k: v.detach() for k, v in model.state_dict().items()}


def final_weights(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "final" / "model.safetensors"))


def test_two_fsdp_processes_train_what_one_dense_process_does(root):
    """Losses step for step and final weights: FSDP2 on 2 gloo ranks = dense one-process
    PyTorch = slideformer train on the same config (all fp32); the run folder is an app run."""
    folder = export_distributed(run_cfg(root, "fsdp"), root / "export")
    order = np.load(folder / "data" / "order.npy")
    assert order.shape == (STEPS, 2, 2)
    torchrun(folder, 2)

    ref_losses, ref_weights = dense_reference(folder)
    losses = step_losses(root / "fsdp")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=2e-5, atol=0)
    assert losses[-1] < losses[0]  # it trained
    ours = final_weights(root / "fsdp")
    for name, w in ours.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=1e-4, atol=2e-6, msg=name)

    run_training(run_cfg(root, "engine"))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(step_losses(root / "engine")),
                               rtol=2e-5, atol=0)

    client = api.RunClient(root / "fsdp")  # what the app's Runs page reads
    events = list(client.follow(timeout=30))
    assert client.state().state == "finished" and client.state().step == STEPS
    assert [e.step for e in events if isinstance(e, api.StepMetrics)] == list(range(1, STEPS + 1))
    assert api.load_config(root / "fsdp" / "config.toml").train.max_steps == STEPS
    assert api.inspect_model(root / "fsdp" / "final")  # a model folder the app opens


def test_cli_writes_the_folder_and_refuses_to_overwrite(root, tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(config_mod.dumps(run_cfg(root, "cli")))
    out = tmp_path / "job"
    assert main(["export-distributed", "--config", str(path), "--out", str(out),
                 "--max-steps", "3"]) == 0
    assert "torchrun.sh" in capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {"train_fsdp.py", "torchrun.sh", "settings.json",
                                               "config.toml", "data"}
    settings = json.loads((out / "settings.json").read_text())
    assert settings["steps"] == 3 and len(settings["lrs"]) == 3
    header = (out / "train_fsdp.py").read_text()
    assert "--nnodes" in header and "--rdzv-endpoint" in header  # multi-node flags documented
    assert not re.search(r"^\s*(from|import) slideformer", header, re.M)  # self-contained
    before = sorted(p.name for p in out.rglob("*"))
    assert main(["export-distributed", "--config", str(path), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in out.rglob("*")) == before


def test_adapter_runs_are_refused(root, tmp_path):
    with pytest.raises(api.UserError, match="train.method"):
        export_distributed(run_cfg(root, "lora", method="lora"), tmp_path / "x")
    assert not (tmp_path / "x").exists()
