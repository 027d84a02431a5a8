"""Hostile inputs, category hangs: absurd batch, layer and step counts are refused (or planned)
at once, and SIGTERM during setup stops the process instead of being ignored.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hostile_corpus import HANGS, make_workspace, params, run_in_process

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-hangs"))


@pytest.mark.parametrize("case", params(HANGS))
def test_hangs_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)


def test_sigterm_during_setup_stops_the_process(pristine, tmp_path):
    """The setup tokenizes ~24 MB of text (many seconds here); SIGTERM arrives in the middle."""
    import shutil
    w = tmp_path / "w"
    shutil.copytree(pristine, w)
    line = json.dumps({"text": "the model reads a long line of words to learn " * 20}) + "\n"
    (w / "big.jsonl").write_text(line * 24_000)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "slideformer.engine.cli", "train", "--config", "run.toml",
                          "--data", "big.jsonl"], cwd=w, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    events = w / "run" / "events.jsonl"
    while not (events.is_file() and b'"setup"' in events.read_bytes()):  # or until it ends
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    time.sleep(0.5)  # into the data preparation
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate()  # a process that ignored the signal ends with its training
    assert p.returncode == 130, (out, err)
    assert "interrupted" in err and "Traceback" not in err
    assert b'"StepMetrics"' not in events.read_bytes()  # nothing trained, nothing saved
    assert not (w / "run" / "final").exists()
    assert not list((w / "run").glob("checkpoints/step-*"))
