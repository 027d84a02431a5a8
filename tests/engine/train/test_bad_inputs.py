"""Bad inputs to ``slideformer train``: model folders, datasets, config files, flags, budgets and
checkpoint folders.

Each one must give one message that names what is wrong, where, and how to fix it; a non-zero
exit; no traceback; and leave every file the user had as it was (the run's event log and the
engine log may only grow).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from slideformer.engine import config as config_mod
from slideformer.engine.cli import main
from slideformer.engine.models.tiny import TinyShape, make_tiny_model
from slideformer.engine.train.commands import run_training
from slideformer.engine.train.demo import write_task

APPEND_ONLY = {"events.jsonl", "engine.log"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """A model, data, and a finished run with two checkpoints (copied for each case)."""
    root = tmp_path_factory.mktemp("bad-inputs")
    make_tiny_model(root / "model", "llama", TinyShape(layers=2, hidden=32, heads=2, kv_heads=1,
                                                       intermediate=48), seed=5)
    write_task(root / "train.jsonl", 60, 1)
    write_task(root / "val.jsonl", 10, 2)
    cfg = config_mod.from_dict({
        "model": {"path": "model"}, "data": {"train": "train.jsonl", "max_seq_len": 32},
        "train": {"micro_batch": 2, "max_steps": 3, "save_every": 1, "device": "cpu"},
        "budget": {"slots": 2}, "output": {"run_dir": "done"}})
    (root / "run.toml").write_text(config_mod.dumps(cfg))
    cwd = os.getcwd()
    os.chdir(root)  # the config's paths are relative to the work folder of each case
    try:
        assert run_training(cfg) == "finished"
    finally:
        os.chdir(cwd)
    return root


def train(*args: str) -> list[str]:
    """A run of the pristine model and data in ``run``, with ``args`` added."""
    return ["train", "--config", "run.toml", "--run-dir", "run", *args]


def resume(*args: str) -> list[str]:
    return ["train", "--config", "run.toml", "--resume", *args]


def edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def write(path: Path, text: str | bytes) -> None:
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def damage_all_checkpoints(w: Path) -> None:
    for d in (w / "done" / "checkpoints").glob("step-*"):
        data = bytearray((d / "layer0.safetensors").read_bytes())
        data[-3] ^= 0x10
        (d / "layer0.safetensors").write_bytes(bytes(data))


def only_unfinished_checkpoint(w: Path) -> None:
    root = w / "done" / "checkpoints"
    for d in list(root.glob("step-*")):
        d.rename(root / f".{d.name}.tmp")


def other_tokenizer(w: Path) -> None:
    """The run's model with another tokenizer (trained from another seed)."""
    shutil.copytree(w / "model", w / "model3")
    make_tiny_model(w / "tok", "llama", TinyShape(layers=1), seed=9)
    shutil.copy2(w / "tok" / "tokenizer.json", w / "model3" / "tokenizer.json")


def other_model(w: Path) -> None:
    make_tiny_model(w / "model2", "llama", TinyShape(layers=2, hidden=48, heads=2, kv_heads=1,
                                                     intermediate=48), seed=6)


# name -> (prepare the work folder w, CLI arguments, words the message must contain)
CASES = {
    # ---- model folders
    "model folder missing": (None, train("--model", "nowhere"), ["nowhere", "not a folder"]),
    "model path is a file": (None, train("--model", "train.jsonl"),
                             ["train.jsonl", "not a folder"]),
    "config.json missing": (lambda w: (w / "model" / "config.json").unlink(), train(),
                            ["config.json", "missing"]),
    "config.json not JSON": (lambda w: write(w / "model" / "config.json", "{"), train(),
                             ["config.json", "not valid JSON"]),
    "unknown model_type": (lambda w: edit_json(w / "model" / "config.json", model_type="gpt9"),
                           train(), ["gpt9", "not supported"]),
    "hidden_size zero": (lambda w: edit_json(w / "model" / "config.json", hidden_size=0), train(),
                         ["hidden_size", "positive"]),
    "no safetensors": (lambda w: (w / "model" / "model.safetensors").unlink(), train(),
                       ["safetensors"]),
    "truncated safetensors": (lambda w: os.truncate(w / "model" / "model.safetensors", 100),
                              train(), ["model.safetensors", "re-download"]),
    "weights do not fit config": (lambda w: edit_json(w / "model" / "config.json",
                                                      intermediate_size=40), train(), ["shape"]),
    "tokenizer.json missing": (lambda w: (w / "model" / "tokenizer.json").unlink(), train(),
                               ["tokenizer.json", "missing"]),
    # ---- datasets
    "data file missing": (None, train("--data", "nothing.jsonl"), ["nothing.jsonl"]),
    "data file empty": (lambda w: write(w / "train.jsonl", ""), train(), ["train.jsonl"]),
    "broken JSONL line": (lambda w: write(w / "train.jsonl", (w / "train.jsonl").read_text()
                                          + '{"messages": [\n'), train(), ["train.jsonl", "61"]),
    "records of no known format": (lambda w: write(w / "train.jsonl", '{"foo": 1}\n' * 20), train(),
                                   ["train.jsonl"]),
    "not UTF-8": (lambda w: write(w / "train.jsonl", b"\xff\xfe\x00bad\n" * 20), train(),
                  ["train.jsonl"]),
    "validation file missing": (None, train("--validation", "val-missing.jsonl"),
                                ["val-missing.jsonl"]),
    "too little data for one step": (None, train("--micro-batch", "64"), ["micro_batch"]),
    "format override mismatched": (None, train("--set", 'data.format="alpaca"'), ["alpaca"]),
    "records too long with truncation=error": (
        None, train("--seq-len", "8", "--set", 'data.truncation="error"'), ["8"]),
    # ---- config files
    "config file missing": (None, ["train", "--config", "nope.toml"],
                            ["nope.toml", "does not exist"]),
    "TOML syntax error": (lambda w: write(w / "run.toml", "[model\npath = 1\n"), train(),
                          ["run.toml", "not valid TOML"]),
    "unknown section": (lambda w: write(w / "run.toml", (w / "run.toml").read_text()
                                        + "\n[extras]\nx = 1\n"), train(), ["[extras]"]),
    "unknown key": (lambda w: write(w / "run.toml", (w / "run.toml").read_text().replace(
        "[optim]", "[optim]\nlearning_rate = 1")), train(), ["optim.learning_rate"]),
    "wrong type": (lambda w: write(w / "run.toml", (w / "run.toml").read_text().replace(
        "micro_batch = 2", 'micro_batch = "two"')), train(), ["train.micro_batch", "int"]),
    "section that is not a table": (lambda w: write(w / "run.toml", "model = 3\n"), train(),
                                    ["[model]", "table"]),
    "unknown schedule": (None, train("--set", 'optim.schedule="triangle"'), ["triangle"]),
    "unknown compute dtype": (None, train("--set", 'train.compute_dtype="fp8"'), ["fp8"]),
    "float16 moments": (None, train("--set", 'optim.moments_dtype="float16"'), ["moments_dtype"]),
    "zero micro-batch": (None, train("--micro-batch", "0"), ["train.micro_batch"]),
    "keep no checkpoint": (None, train("--set", "train.keep_checkpoints=0"),
                           ["train.keep_checkpoints"]),
    "negative save_every": (None, train("--save-every", "-1"), ["train.save_every"]),
    "no steps at all": (None, train("--max-steps", "0", "--epochs", "0"), ["train.epochs"]),
    "unreadable shard size": (None, train("--set", 'output.shard_size="big"'),
                              ["output.shard_size"]),
    # ---- flags
    "--set without =": (None, train("--set", "optim.lr"), ["--set", "SECTION.KEY=VALUE"]),
    "--set of no section": (None, train("--set", "nosuch.key=1"), ["nosuch"]),
    "--max-steps not a number": (None, train("--max-steps", "abc"), ["--max-steps", "invalid int"]),
    "no model given": (None, ["train", "--data", "train.jsonl"], ["model.path", "--model"]),
    "zero sequence length": (None, train("--seq-len", "0"), ["data.max_seq_len"]),
    "unknown device": (None, train("--device", "tpu"), ["train.device", "tpu"]),
    "--resume of a fresh folder": (None, train("--resume"), ["run", "no checkpoint"]),
    "run folder in use": (lambda w: (w / "run").mkdir() or write(w / "run" / "notes.txt", "mine"),
                          train(), ["already holds a run"]),
    "run folder is a file": (lambda w: write(w / "run", "a file"), train(), ["run", "is a file"]),
    # ---- budgets
    "unreadable RAM budget": (None, train("--set", 'budget.ram="lots"'), ["budget.ram", "lots"]),
    "RAM budget too small": (None, train("--set", 'budget.ram="1MiB"'), ["budget.ram", "host RAM"]),
    "negative VRAM budget": (None, train("--set", 'budget.vram="-5GiB"'), ["budget.vram"]),
    "unknown checkpoint placement": (None, train("--set", 'budget.checkpoints="disk"'),
                                     ["budget.checkpoints", "disk"]),
    "negative slots": (None, train("--slots", "-1"), ["budget.slots"]),
    "NVMe size without a folder": (None, train("--set", 'budget.nvme_size="10GiB"'),
                                   ["budget.nvme_size", "nvme_dir"]),
    # ---- checkpoint folders
    "only an unfinished checkpoint": (only_unfinished_checkpoint, resume(),
                                      ["checkpoint to resume from"]),
    "every checkpoint damaged": (damage_all_checkpoints, resume(),
                                 ["holds no intact checkpoint", "sha256"]),
    "checkpoint of another model": (other_model, resume("--model", "model2"),
                                    ["another model", "checkpointed run"]),
    # the same architecture with another tokenizer: more rows of tokens, yet the model is named
    "checkpoint of another tokenizer": (other_tokenizer, resume("--model", "model3"),
                                        ["model3", "config.json", "another model",
                                         "tokenizer.json sha256", "checkpointed run"]),
    "checkpoint of another precision": (None, resume("--set", 'train.compute_dtype="bfloat16"'),
                                        ["train.compute_dtype", "float32 state"]),
    "resume with other batch settings": (None, resume("--micro-batch", "1"),
                                         ["micro_batch", "checkpoint"]),
    "resume with other data": (lambda w: write_task(w / "train.jsonl", 90, 7), resume(),
                               ["data.train", "train.jsonl", "contents", "checkpoint"]),
}


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and ".token-cache" not in p.parts}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_clear_message(name, pristine, tmp_path, capsys, monkeypatch):
    prepare, args, words = CASES[name]
    w = tmp_path / "w"
    shutil.copytree(pristine, w, symlinks=True)
    monkeypatch.chdir(w)
    if prepare is not None:
        prepare(w)
    before = snapshot(w)
    try:
        code = main(args)
    except SystemExit as e:  # argparse: usage and one error line
        code = e.code
    err = capsys.readouterr().err
    assert code not in (0, None), err
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert sum(x.startswith("error:") or ": error:" in x for x in lines) == 1, err
    assert "fix:" in err or "usage:" in err, err
    for word in words:
        assert word in err, f"{word!r} not in: {err}"
    after = snapshot(w)
    for path, data in before.items():
        if Path(path).name in APPEND_ONLY:
            assert after.get(path, b"").startswith(data), f"{path} was rewritten"
        else:
            assert after.get(path) == data, f"{path} was changed or removed"
