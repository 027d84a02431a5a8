"""Resuming with changed settings: every key of the run config is decided
(slideformer.engine.train.resume.RULES), every refused change stops ``slideformer train --resume``
with one message naming the setting, its old and new value and the fix (exit code 2, the run
folder untouched), and the allowed ones resume with the warning that lists them.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest

from slideformer.engine import config as config_mod
from slideformer.engine.cli import main
from slideformer.engine.errors import UserError
from slideformer.engine.events import Log, read_events
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.train import resume
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A model, data, and two finished runs of 3 steps: ``full`` and ``lora`` (copied per case)."""
    root = tmp_path_factory.mktemp("resume-settings")
    make_tiny_model(root / "model", "llama", TinyShape(layers=2, hidden=32, heads=2, kv_heads=1,
                                                       intermediate=48), seed=5)
    write_task(root / "train.jsonl", 60, 1)
    write_task(root / "other.jsonl", 60, 7)
    cwd = os.getcwd()
    os.chdir(root)  # the configs' paths are relative to the work folder of each case
    try:
        for method in ("full", "lora"):
            cfg = config_mod.from_dict({
                "model": {"path": "model"}, "data": {"train": "train.jsonl", "max_seq_len": 32},
                "train": {"micro_batch": 2, "max_steps": 3, "save_every": 1, "device": "cpu",
                          "method": method},
                "budget": {"slots": 2}, "output": {"run_dir": method}})
            (root / f"{method}.toml").write_text(config_mod.dumps(cfg))
            assert run_training(cfg) == "finished"
    finally:
        os.chdir(cwd)
    return root


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_every_config_key_has_a_rule():
    keys = {f"{section.name}.{f.name}" for section in dataclasses.fields(config_mod.RunConfig)
            for f in dataclasses.fields(section.default_factory())}
    assert keys == set(resume.RULES)
    assert resume.COMPARED_OTHERWISE <= {k for k, r in resume.RULES.items() if r.refuse}


# refused key -> (the run it resumes, the value given with --set)
REFUSED = {
    "data.train": ("full", "other.jsonl"),
    "data.format": ("full", "alpaca"),
    "data.val_fraction": ("full", 0.1),
    "data.max_seq_len": ("full", 24),
    "data.packing": ("full", False),
    "data.train_on": ("full", "all"),
    "data.mask_history": ("full", True),
    "data.truncation": ("full", "drop"),
    "data.max_samples": ("full", 50),
    "data.chat_template": ("full", "chatml"),
    "data.enable_thinking": ("full", False),
    "data.seed": ("full", 1),
    "data.columns": ("full", {"prompt": "question"}),  # named as data.columns.prompt
    "data.mix": ("full", [{"path": "other.jsonl", "weight": 0.5}]),
    "optim.moments_dtype": ("full", "bfloat16"),
    "train.micro_batch": ("full", 1),
    "train.grad_accum": ("full", 2),
    "train.compute_dtype": ("full", "bfloat16"),
    "train.objective": ("full", "dpo"),
    "train.method": ("full", "lora"),
    "lora.rank": ("lora", 4),
    "lora.alpha": ("lora", 16.0),
    "lora.target_modules": ("lora", "q_proj,v_proj"),
    "lora.use_rslora": ("lora", True),
}
NOT_SETTABLE = {"preference.reference"}
"""Refused keys with one valid value today: checked on the rule itself below."""


def test_every_refused_key_is_tested():
    assert {k for k, r in resume.RULES.items() if r.refuse} == set(REFUSED) | NOT_SETTABLE


def _toml(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(value)


def _resume(w: Path, run: str, capsys, *args: str) -> tuple[int, str]:
    code = main(["train", "--config", f"{run}.toml", "--resume", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_refused_change_gives_one_message_and_changes_nothing(key, pristine, tmp_path, capsys,
                                                                monkeypatch):
    run, value = REFUSED[key]
    w = tmp_path / "w"
    shutil.copytree(pristine, w, symlinks=True)
    monkeypatch.chdir(w)
    before = snapshot(w / run)
    code, err = _resume(w, run, capsys, "--set", f"{key}={_toml(value)}")
    assert code == 2, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert len(lines) == 2 and lines[0].startswith(f"error: {key}") and "fix:" in lines[1], err
    assert "Traceback" not in err
    if key in resume.COMPARED_OTHERWISE:  # contents and resolved dtypes are named as such
        assert "checkpoint" in lines[0], err
    else:
        old = config_mod.to_dict(config_mod.load(w / f"{run}.toml"))
        section, name = key.split(".")
        was, now = old[section][name], value
        if isinstance(value, dict):  # a table: the changed key inside it
            (sub, now), = value.items()
            was, key = was[sub], f"{key}.{sub}"
            assert lines[0].startswith(f"error: {key}: ")
        assert f"was {json.dumps(was)} " in lines[0], err
        assert f"now {json.dumps(now)}" in lines[0], err
        assert f"resume with {key} = {json.dumps(was)}" in lines[1], err
        assert resume.RULES[f"{section}.{name}"].why in lines[0]
    assert "--resume" in lines[1]
    assert snapshot(w / run) == before


def test_the_reference_of_a_preference_run_is_refused_by_its_rule():
    """preference.reference has one value today; a checkpoint of another one is refused."""
    cfg = config_mod.from_dict({"model": {"path": "m"}, "train": {"objective": "dpo"}})
    old = config_mod.to_dict(cfg)
    old["preference"]["reference"] = "previous"
    now = {"model": {}, "compute_dtype": "float32", "sources": None}
    with pytest.raises(UserError) as e:
        resume.check({"config": old, "model": {}}, cfg, now)
    assert e.value.where == "preference.reference" and '"previous"' in e.value.problem


def test_several_refused_changes_are_one_message(pristine, tmp_path, capsys, monkeypatch):
    w = tmp_path / "w"
    shutil.copytree(pristine, w, symlinks=True)
    monkeypatch.chdir(w)
    code, err = _resume(w, "full", capsys, "--micro-batch", "1", "--seq-len", "24",
                        "--lr", "1e-3")
    assert code == 2
    assert err.startswith("error: data.max_seq_len, train.micro_batch: changed since"), err
    assert "optim.lr" not in err and sum(x.startswith("error:") for x in err.splitlines()) == 1


def test_data_edited_in_place_is_refused_naming_the_file(pristine, tmp_path, capsys, monkeypatch):
    w = tmp_path / "w"
    shutil.copytree(pristine, w, symlinks=True)
    monkeypatch.chdir(w)
    shutil.copy2(w / "other.jsonl", w / "train.jsonl")
    code, err = _resume(w, "full", capsys)
    assert code == 2
    assert err.startswith("error: data.train: train.jsonl: its contents are not those"), err
    assert "(the checkpointed run read" not in err  # the same path


def test_allowed_changes_resume_with_the_warning(pristine, tmp_path, capsys, monkeypatch):
    """A data file moved to another folder (same name and contents: the token cache's key), a
    moved model folder and the allowed keys."""
    w = tmp_path / "w"
    shutil.copytree(pristine, w, symlinks=True)
    monkeypatch.chdir(w)
    (w / "moved").mkdir()
    shutil.move(w / "train.jsonl", w / "moved" / "train.jsonl")
    shutil.move(w / "model", w / "model-moved")
    n = len(read_events(w / "full" / "events.jsonl"))
    code, err = _resume(w, "full", capsys, "--data", "moved/train.jsonl", "--model", "model-moved",
                        "--max-steps", "4", "--lr", "1e-3", "--set", "train.keep_checkpoints=1",
                        "--set", 'data.ignore_fields=["note"]', "--validation", "other.jsonl",
                        "--set", 'budget.checkpoints="host"', "--set", "optim.beta1=0.8")
    assert code == 0, err
    logs = [e.message for e in read_events(w / "full" / "events.jsonl")[n:] if isinstance(e, Log)]
    warning, = [m for m in logs if m.startswith("resuming with changed settings: ")]
    for key in ("data.train", "model.path", "train.max_steps", "optim.lr", "optim.beta1",
                "train.keep_checkpoints", "data.ignore_fields", "data.validation",
                "budget.checkpoints"):
        assert key in warning, warning
    assert sorted(p.name for p in (w / "full" / "checkpoints").iterdir()) == ["step-4"]
