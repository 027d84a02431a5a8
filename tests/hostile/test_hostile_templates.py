"""Hostile inputs, category templates: Chat templates that loop, allocate or recurse without bound: each is refused by the sandbox or its render budget.

Each case runs ``slideformer`` in-process and must exit 2 with one message naming the file or key
(tests/hostile/hostile_corpus.py; test_hostile_corpus.py runs the same cases in a subprocess).
"""
from __future__ import annotations

import pytest
from hostile_corpus import TEMPLATES, make_workspace, params, run_in_process


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("hostile-templates"))


@pytest.mark.parametrize("case", params(TEMPLATES))
def test_templates_case(case, pristine, tmp_path, capsys, monkeypatch):
    run_in_process(case, pristine, tmp_path, capsys, monkeypatch)
