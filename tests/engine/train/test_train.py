"""The Trainer end to end on the CPU: CLI runs, exact resume, exported model, the demo learns."""
from __future__ import annotations

import json

import pytest
import torch

from slideformer.engine import config as config_mod
from slideformer.engine.cli import main
from slideformer.engine.events import StepMetrics, read_events
from slideformer.engine.models.tiny import TinyShape
from slideformer.engine.train.commands import run_demo, run_training


TRAIN = {"data.max_seq_len": 64, "train.grad_accum": 2}
"""This module's run settings over the tiny run's (tests/conftest.py)."""
TASK = dict(arch="qwen2", shape=TinyShape(layers=3, tie=True), seed=4, rows=300, validation=20)
"""This module's tiny model (tied embeddings) and data (with a validation set)."""


@pytest.fixture(scope="module")
def run_cfg(tiny_run):
    """``make(run_dir, **train) -> RunConfig``: this module's run; ``train`` sets train.* keys."""
    return lambda run_dir, **train: tiny_run(
        run_dir, {**TRAIN, **{f"train.{k}": v for k, v in train.items()}}, **TASK)


def step_losses(run_dir):
    last = {}
    for ev in read_events(run_dir / "events.jsonl"):
        if isinstance(ev, StepMetrics):
            last[ev.step] = ev.loss  # a resumed run re-reports nothing twice
    return [last[k] for k in sorted(last)]


def final_weights(run_dir):
    from safetensors.torch import load_file
    return load_file(str(run_dir / "final" / "model.safetensors"))


@pytest.mark.parametrize("moments", ["float32", "int8"])
def test_interrupted_and_resumed_run_equals_uninterrupted(tiny_run, tmp_path, moments):
    """Bitwise, with fp32 moments and with 8-bit ones (blocks of codes and scales, saved as
    bytes)."""
    run_cfg = lambda run_dir: tiny_run(run_dir, {**TRAIN, "optim.moments_dtype": moments}, **TASK)  # noqa: E731
    run_training(run_cfg(tmp_path / "a"))

    from slideformer.engine.train.trainer import Trainer
    cfg = run_cfg(tmp_path / "b")
    t = Trainer(cfg, callbacks=[lambda ev: isinstance(ev, StepMetrics) and ev.step == 3 and t.stop(True)])
    t.setup()
    assert t.train() == "stopped"
    t.cleanup()
    assert (tmp_path / "b" / "checkpoints" / "step-3" / "trainer.json").is_file()
    assert run_training(cfg, resume=True) == "finished"

    assert step_losses(tmp_path / "b") == step_losses(tmp_path / "a")  # bitwise on CPU fp32
    wa, wb = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_cli_train_from_toml_and_export_loads_in_transformers(run_cfg, tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    cfg = run_cfg(tmp_path / "run")
    path = tmp_path / "run.toml"
    path.write_text(config_mod.dumps(cfg))
    assert main(["train", "--config", str(path), "--max-steps", "4", "--set", "optim.lr=1e-3"]) == 0
    out = capsys.readouterr().out
    assert "4/4 steps" in out  # the progress bar, one line per step into a non-terminal
    saved = config_mod.load(tmp_path / "run" / "config.toml")
    assert saved.train.max_steps == 4 and saved.optim.lr == 1e-3
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    ours = final_weights(tmp_path / "run")
    for name, p in hf.state_dict().items():
        if name in ours:
            assert torch.equal(p, ours[name]), name
    evs = read_events(tmp_path / "run" / "events.jsonl")
    kinds = {type(e).__name__ for e in evs}
    assert {"RunState", "StepMetrics", "Timeline", "EvalMetrics"} <= kinds
    tl = next(e for e in evs if type(e).__name__ == "Timeline")
    assert {s.lane for s in tl.spans} >= {"compute", "h2d", "d2h", "optimizer"}


@pytest.mark.parametrize("args,needle", [
    (["--max-steps", "2"], "model.path"),
    (["--model", "X", "--data", "Y", "--set", "train.nope=1"], "unknown key 'train.nope'"),
    (["--model", "X", "--data", "Y", "--set", "train.micro_batch='a'"], "train.micro_batch"),
])
def test_cli_train_bad_config(args, needle, tmp_path, capsys):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and "fix:" in err and "Traceback" not in err


def test_run_dir_in_use_is_refused(run_cfg, tmp_path, capsys):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "notes.txt").write_text("mine")
    cfg = run_cfg(tmp_path / "used")
    path = tmp_path / "c.toml"
    path.write_text(config_mod.dumps(cfg))
    assert main(["train", "--config", str(path)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert (tmp_path / "used" / "notes.txt").read_text() == "mine"


def test_demo_learns(tmp_path):
    """The README's main job: held-out loss at least halves and the task score rises."""
    r = run_demo(tmp_path, steps=150)
    print(json.dumps({k: str(v) for k, v in r.items()}))
    assert r["loss_after"] <= r["loss_before"] / 2
    assert r["score_after"] > r["score_before"]


def test_step_events_carry_the_rate_the_step_used(run_cfg, tmp_path):
    """Step k's event shows lr_at(k): warmup 1/2, 2/2 of lr, then the cosine decay."""
    from slideformer.engine.train.schedule import lr_at
    cfg = run_cfg(tmp_path / "run", max_steps=4)
    run_training(cfg)
    events = [ev for ev in read_events(tmp_path / "run" / "events.jsonl") if isinstance(ev, StepMetrics)]
    assert [ev.step for ev in events] == [1, 2, 3, 4]
    assert [ev.lr for ev in events] == [lr_at(k, 4, cfg.optim) for k in (1, 2, 3, 4)]
    assert events[0].lr == cfg.optim.lr / 2  # warmup_steps=2: the first step runs at half the rate


def test_a_flex_attention_fallback_is_a_warning_in_the_run(run_cfg, tmp_path, monkeypatch):
    """kernels.attention leaves a notice when FlexAttention ran uncompiled; the trainer turns
    it into one warning event after the step (on the CPU no run compiles it: the notice is
    planted)."""
    from slideformer.engine.events import Log
    from slideformer.engine.kernels import attention
    monkeypatch.setattr(attention, "_FALLBACK", {"seen": True, "notice": "FlexAttention ran uncompiled"})
    run_training(run_cfg(tmp_path / "run", max_steps=2))
    warnings = [ev.message for ev in read_events(tmp_path / "run" / "events.jsonl")
                if isinstance(ev, Log) and ev.level == "warning"]
    assert warnings.count("FlexAttention ran uncompiled") == 1
