"""Hostile inputs, category preference: DPO pairs and KTO records that are broken or contradict
the objective, and preference settings that cannot work: each one message naming the record
(file:line) or the key, exit 2, before anything is trained.

Each case runs ``slideformer`` in-process (tests/hostile/hostile_corpus.py; test_hostile_corpus.py
runs the same cases in a subprocess).
"""
from __future__ import annotations

import pytest
from hostile_corpus import PREFERENCE, make_workspace, params, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-preference"))


@pytest.mark.parametrize("case", params(PREFERENCE))
def test_preference_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
    assert not (tmp_path / "w" / "run" / "checkpoints").exists()  # nothing was trained
