"""Hostile inputs, category tracebacks: Inputs that once ended in a traceback: sizes, non-finite numbers, config.json and tokenizer_config.json values of the wrong type, hostile JSON, non-UTF-8 names, files where folders should be, broken hardware profiles.

Each case runs ``slideformer`` in-process and must exit 2 with one message naming the file or key
(tests/hostile/hostile_corpus.py; test_hostile_corpus.py runs the same cases in a subprocess).
"""
from __future__ import annotations

import pytest
from hostile_corpus import TRACEBACKS, make_workspace, params, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-tracebacks"))


@pytest.mark.parametrize("case", params(TRACEBACKS))
def test_tracebacks_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
