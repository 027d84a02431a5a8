"""Hostile inputs, category misleading: Inputs whose message once blamed the wrong setting: a huge max_seq_len, a NaN learning rate, NaN weights (the tensor must be named).

Each case runs ``slideformer`` in-process and must exit 2 with one message naming the file or key
(tests/hostile/hostile_corpus.py; test_hostile_corpus.py runs the same cases in a subprocess).
"""
from __future__ import annotations

import pytest
from hostile_corpus import MISLEADING, make_workspace, params, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-misleading"))


@pytest.mark.parametrize("case", params(MISLEADING))
def test_misleading_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
