"""Early stopping, keep_best and experiment tracking on the CPU.

The validation set is built to get worse as the model learns: the training text says only
``x y x y ...`` and the validation text holds none of those letters, so every step that makes
x and y likelier makes the validation letters less likely.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from slideformer.engine import config as config_mod
from slideformer.engine.errors import UserError
from slideformer.engine.events import CheckpointSaved, EvalMetrics, Log, RunState, StepMetrics, read_events
from slideformer.engine.train.commands import run_training
from slideformer.engine.validate import validate

STEPS = 12


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("early")
    for name, text, rows in (("train", "xy" * 12, 40), ("val", "abcdefghijklmnopqrstuvw", 8)):
        with open(root / f"{name}.jsonl", "w") as f:
            for i in range(rows):
                f.write(json.dumps({"text": text if name == "val" else " ".join(text)}) + "\n")
    (root / "runs").mkdir()
    return root


@pytest.fixture(scope="module")
def make(tiny_run, texts):
    def make(name: str, **over) -> config_mod.RunConfig:
        cfg = tiny_run(texts / "runs" / name, {
            "data.train": str(texts / "train.jsonl"), "data.validation": str(texts / "val.jsonl"),
            "data.format": "text", "optim.schedule": "constant", "optim.warmup_steps": 0,
            "optim.lr": 5e-3, "train.max_steps": STEPS, "train.eval_every": 1,
            **{k.replace("__", "."): v for k, v in over.items()}})
        return cfg
    return make


def events(cfg, kind) -> list:
    return [e for e in read_events(Path(cfg.output.run_dir) / "events.jsonl")
            if isinstance(e, kind)]


def final(cfg) -> dict:
    return load_file(str(Path(cfg.output.run_dir) / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def early(make):
    cfg = make("early", train__early_stopping_patience=2, output__keep_best=True,
               train__keep_checkpoints=1, train__save_every=1)
    assert run_training(cfg) == "finished"
    return cfg


def test_a_rising_validation_loss_stops_the_run_and_exports_the_best_step(early, make):
    vals = [(e.step, e.val_loss) for e in events(early, EvalMetrics)]
    steps = [e.step for e in events(early, StepMetrics)]
    best_step, best = min(vals, key=lambda sv: sv[1])
    # patience 2: the run stops at the second evaluation in a row without a new best
    after = [s for s, v in vals if s > best_step]
    assert len(after) == 2 and all(v >= best for s, v in vals if s > best_step)
    assert steps[-1] == after[-1] < STEPS
    assert [s for s, _ in vals] == sorted({s for s, _ in vals})  # each step evaluated once
    end = events(early, RunState)[-1]
    assert end.state == "finished" and "stopped early" in end.message
    assert f"(the best checkpoint: step {best_step}, validation loss {best:.4f})" in end.message
    # the best checkpoint survives keep_checkpoints = 1 beside the newest one
    kept = sorted(int(p.name[5:]) for p in (Path(early.output.run_dir) / "checkpoints").glob("step-*"))
    assert kept == sorted({best_step, steps[-1]})
    marks = [e.step for e in events(early, CheckpointSaved) if e.best]
    assert marks and marks[-1] == best_step
    # final/ is the model of the best step: a plain run of best_step steps gives the same weights
    plain = make("plain-best", train__max_steps=best_step, train__eval_every=0)
    assert run_training(plain) == "finished"
    a, b = final(early), final(plain)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_early_stopped_run_resumes_to_the_same_stop(early, make, texts):
    # interrupted before the stop, then resumed: the patience count comes back with the state
    cfg = make("early-resumed", train__early_stopping_patience=2, output__keep_best=True,
               train__keep_checkpoints=1, train__save_every=1)
    stop_step = events(early, StepMetrics)[-1].step
    first = config_mod.override(cfg, {"train.max_steps": stop_step - 1})
    assert run_training(first) == "finished"
    assert run_training(cfg, resume=True) == "finished"
    assert events(cfg, StepMetrics)[-1].step == stop_step
    a, b = final(early), final(cfg)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_tensorboard_gets_the_losses_of_events_jsonl(make):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    cfg = make("tb", train__max_steps=4, train__eval_every=2, output__report_to=["tensorboard"])
    assert run_training(cfg) == "finished"
    acc = EventAccumulator(str(Path(cfg.output.run_dir) / "tensorboard"))
    acc.Reload()
    steps = {e.step: e for e in events(cfg, StepMetrics)}
    logged = {s.step: s.value for s in acc.Scalars("train/loss")}
    assert sorted(logged) == sorted(steps) == [1, 2, 3, 4]
    for step, value in logged.items():  # TensorBoard keeps float32
        assert value == pytest.approx(steps[step].loss, rel=1e-6)
    vals = {s.step: s.value for s in acc.Scalars("eval/val_loss")}
    assert vals == pytest.approx({e.step: e.val_loss for e in events(cfg, EvalMetrics)}, rel=1e-6)
    assert {s.step for s in acc.Scalars("train/tokens_per_s")} == set(steps)
    assert not [e for e in events(cfg, Log) if "report_to" in e.message]


def test_mlflow_gets_the_losses_of_events_jsonl(make):
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")  # MLflow's SQLite store
    cfg = make("mlflow", train__max_steps=3, train__eval_every=0, output__report_to=["mlflow"])
    assert run_training(cfg) == "finished"
    db = (Path(cfg.output.run_dir) / "mlflow.db").resolve()
    client = mlflow.tracking.MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([client.get_experiment_by_name("slideformer").experiment_id])
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}
    assert history == pytest.approx({e.step: e.loss for e in events(cfg, StepMetrics)}, rel=1e-9)
    assert run.data.params["optim.lr"] == str(cfg.optim.lr)


def test_wandb_offline_gets_the_losses_of_events_jsonl(make, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = make("wandb", train__max_steps=3, train__eval_every=0, output__report_to=["wandb"])
    assert run_training(cfg) == "finished"
    # the offline run's record log keeps each history value as JSON text (read by `wandb sync`)
    (log,) = (Path(cfg.output.run_dir) / "wandb").glob("offline-run-*/run-*.wandb")
    records = log.read_bytes()
    assert b"train/loss" in records
    assert all(json.dumps(e.loss).encode() in records for e in events(cfg, StepMetrics))
    assert not [e for e in events(cfg, Log) if "report_to" in e.message]


def test_a_tracker_that_fails_is_dropped_with_a_warning(make, monkeypatch):
    from slideformer.engine import tracking

    class Broken:
        def __init__(self, *a):
            pass

        def log(self, step, values):
            raise ConnectionError("no network")

        def close(self):
            pass

    monkeypatch.setitem(tracking._OPEN, "tensorboard", Broken)
    monkeypatch.setattr(tracking, "check_installed", lambda names: None)
    cfg = make("broken-tracker", train__max_steps=2, output__report_to=["tensorboard"])
    assert run_training(cfg) == "finished"
    warned = [e.message for e in events(cfg, Log) if "report_to" in e.message]
    assert len(warned) == 1 and "tensorboard failed (ConnectionError: no network)" in warned[0]


@pytest.mark.parametrize("over, key, says", [
    ({"train.early_stopping_patience": 3}, "train.early_stopping_patience", "train.eval_every"),
    ({"output.keep_best": True}, "output.keep_best", "train.eval_every"),
    ({"output.keep_best": True, "train.eval_every": 5, "data.validation": ""},
     "output.keep_best", "validation split"),
    ({"train.early_stopping_threshold": -1.0}, "train.early_stopping_threshold", ">= 0"),
    ({"output.report_to": ["tensorbord"]}, "output.report_to[0]", "tensorboard, trackio"),
    ({"output.report_to": ["wandb", "wandb"]}, "output.report_to", "twice"),
])
def test_settings_that_cannot_work_are_refused(make, over, key, says):
    cfg = config_mod.override(make("refused"), {"train.eval_every": 0, **over})
    with pytest.raises(UserError) as e:
        validate(cfg)
    assert str(e.value).startswith(key) and says in str(e.value)


def test_a_missing_tracker_library_is_named_before_anything_loads(make, monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "wandb" else real(name, *a))
    cfg = make("no-wandb", output__report_to=["wandb"])
    with pytest.raises(UserError, match="pip install wandb"):
        run_training(cfg)
    assert not (Path(cfg.output.run_dir) / "checkpoints").exists()
