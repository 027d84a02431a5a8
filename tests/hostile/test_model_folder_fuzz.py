"""Model-folder fuzzing: hostile config.json, tokenizer files, chat templates, safetensors headers
and index files (folder_fuzz's hypothesis strategies), through everything the engine does with a
folder before the first step: read the spec, plan, set up the Trainer (tokenizer, data, weights).

Every example ends in success or in one UserError naming the file at fault (and, for a value of
config.json, the field); another exception is a bug, and so is a hang: a SIGALRM after
:data:`HANG_SECONDS` fails the example (a hang detector, not a speed limit).
"""
from __future__ import annotations

import shutil
import signal
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
from folder_fuzz import breakages, check_refusal
from hostile_corpus import make_workspace
from hypothesis import HealthCheck, given, settings

from slideformer.engine import config as config_mod
from slideformer.engine.errors import UserError
from slideformer.engine.models.spec import load_spec
from slideformer.engine.plan.hardware import REFERENCE
from slideformer.engine.plan.planner import plan_run
from slideformer.engine.train.trainer import Trainer

HANG_SECONDS = 60


class Hang(BaseException):
    """Raised by the alarm (a BaseException: product code's ``except Exception`` cannot eat it)."""


@contextmanager
def hang_guard(seconds: int):
    def on_alarm(signum, frame):
        raise Hang(f"no answer within {seconds} s")
    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("folder-fuzz"))


def load_folder(model: Path, workspace: Path, run_dir: Path) -> None:
    """What the engine does with a model folder before training: spec, plan, Trainer setup."""
    cfg = config_mod.override(config_mod.load(workspace / "run.toml"), {
        "model.path": str(model), "data.train": str(workspace / "train.jsonl"),
        "output.run_dir": str(run_dir)})
    plan_run(cfg, load_spec(model), hardware=REFERENCE)
    trainer = Trainer(cfg)
    try:
        trainer.setup()
    finally:
        trainer.cleanup()


def check_folder(workspace: Path, broken) -> str:
    """Break a copy of the workspace's model and load it: ``refused`` (a UserError that names
    what was broken) or ``loaded``; anything else fails."""
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        shutil.copytree(workspace / "model", model)
        applied = [b for b in broken if b.apply(model)]
        try:
            with hang_guard(HANG_SECONDS):
                load_folder(model, workspace, Path(tmp) / "run")
        except UserError as e:
            check_refusal(e, applied)
            return "refused"
    return "loaded"


_SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                       HealthCheck.filter_too_much])


@settings(max_examples=40, derandomize=True, **_SETTINGS)
@given(broken=breakages)
def test_hostile_model_folders(workspace, broken):
    check_folder(workspace, broken)


@pytest.mark.slow
def test_hostile_model_folders_long(workspace, capsys):
    tally: Counter = Counter()

    @settings(max_examples=1000, **_SETTINGS)
    @given(broken=breakages)
    def run(broken):
        tally[check_folder(workspace, broken)] += 1

    t0 = time.perf_counter()
    run()
    n, wall = sum(tally.values()), time.perf_counter() - t0
    with capsys.disabled():
        print(f"\nmodel-folder fuzzing: {n} folders, {tally['refused']} refused naming the "
              f"file (and field), {tally['loaded']} set up; 0 other exceptions, 0 hangs; "
              f"{wall / n:.2f} s per folder")
