"""Hostile inputs, category silent: Inputs that were once silently accepted: nonsense optimizer settings, quantized weights, a zero head_dim, non-boolean flags, tokenizer ids beyond vocab_size.

Each case runs ``slideformer`` in-process and must exit 2 with one message naming the file or key
(tests/hostile/hostile_corpus.py; test_hostile_corpus.py runs the same cases in a subprocess).
"""
from __future__ import annotations

import pytest
from hostile_corpus import SILENT, make_workspace, params, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-silent"))


@pytest.mark.parametrize("case", params(SILENT))
def test_silent_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
