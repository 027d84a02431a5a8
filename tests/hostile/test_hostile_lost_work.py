"""Lost work: a final export that fails (disk full, read-only folder) keeps every trained step.

The reference is the same run with a working disk: after the failed export, ``--resume`` must
write a final model identical to the reference's, without training again.
"""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
from safetensors import SafetensorError
from safetensors.torch import load_file

from slideformer.engine import config as config_mod
from slideformer.engine.events import RunState, StepMetrics, read_events
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("lost-work")
    make_tiny_model(root / "model", "llama", TinyShape(layers=2, hidden=32, heads=2, kv_heads=1,
                                                       intermediate=48), seed=3)
    write_task(root / "train.jsonl", 40, 1)
    return root


def cfg_of(base: Path, name: str) -> config_mod.RunConfig:
    # no periodic checkpoint: before the fix, the trained state lived only in memory
    return config_mod.from_dict({
        "model": {"path": str(base / "model")},
        "data": {"train": str(base / "train.jsonl"), "max_seq_len": 32},
        "train": {"micro_batch": 2, "max_steps": 3, "save_every": 0, "device": "cpu"},
        "budget": {"slots": 2}, "output": {"run_dir": str(base / name)}})


def final_weights(run: Path) -> dict:
    return load_file(str(run / "final" / "model.safetensors"))


def no_space(*a, **k):
    # what safetensors raises on a full disk (its Rust writer's io::Error, as text)
    raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                          'message: "No space left on device" })')


def read_only(*a, **k):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


@pytest.mark.parametrize("failure,words", [(no_space, "No space left"),
                                           (read_only, "Read-only")])
def test_failed_final_export_keeps_the_trained_state_and_resume_writes_it(base, monkeypatch,
                                                                           failure, words):
    assert run_training(cfg_of(base, f"ref-{failure.__name__}")) == "finished"
    reference = final_weights(base / f"ref-{failure.__name__}")

    run = base / f"fail-{failure.__name__}"
    with monkeypatch.context() as m:
        m.setattr("safetensors.torch.save_file", failure)  # _save_shard imports it per call
        assert run_training(cfg_of(base, run.name)) == "failed"
    end = [e for e in read_events(run / "events.jsonl") if isinstance(e, RunState)][-1]
    assert end.state == "failed" and end.step == 3
    assert words in end.message and "checkpoints/step-3" in end.message
    assert "--resume" in end.message
    assert (run / "checkpoints" / "step-3").is_dir()
    assert not (run / "final").exists() and not (run / "final.partial").exists()

    steps_before = sum(isinstance(e, StepMetrics) for e in read_events(run / "events.jsonl"))
    assert run_training(cfg_of(base, run.name), resume=True) == "finished"
    steps_after = sum(isinstance(e, StepMetrics) for e in read_events(run / "events.jsonl"))
    assert steps_after == steps_before  # the export was retried, nothing trained again
    got = final_weights(run)
    assert got.keys() == reference.keys()
    for name, t in reference.items():
        assert got[name].equal(t), name
